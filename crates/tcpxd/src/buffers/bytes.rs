//! Ranges of a buffer and the byte-level operations on them (`FillBuffer`, `ReadBuffer`,
//! `ChecksumBuffer`), whatever memory the buffer is.

use super::{BufferEntry, BufferMemory, Pattern};
use crate::engine::{Code, EngineError};
use crate::gpu::Stream;

/// Resolves `(offset, length)` against a buffer; `length == 0` with `zero_means_rest` means
/// "to the end".
pub fn resolve_range(
    b: &BufferEntry,
    offset: u64,
    length: u64,
    zero_means_rest: bool,
) -> Result<(u64, u64), EngineError> {
    let length = if length == 0 && zero_means_rest {
        b.size.checked_sub(offset).ok_or_else(|| {
            EngineError::invalid(format!(
                "offset: {offset} is past the end of buffer {} ({} bytes)",
                b.id, b.size
            ))
        })?
    } else {
        length
    };
    match offset.checked_add(length) {
        None => Err(EngineError::invalid(format!(
            "offset + length: {offset} + {length} overflows 64 bits"
        ))),
        Some(end) if end > b.size => Err(EngineError::invalid(format!(
            "offset + length: range {offset}..{end} is past the end of buffer {} ({} bytes)",
            b.id, b.size
        ))),
        Some(_) => Ok((offset, length)),
    }
}

const SCRATCH: usize = 1 << 20;

/// A client's pages the kernel would not copy: the permission is missing (FAILED_PRECONDITION,
/// naming the setting), the client is gone or its memory is (NOT_FOUND / INVALID_ARGUMENT).
pub fn attach_error(e: crate::net::cross_memory::AttachError) -> EngineError {
    use crate::net::cross_memory::AttachError as A;
    let code = match &e {
        A::Denied { .. } => Code::FailedPrecondition,
        A::Gone { .. } => Code::NotFound,
        A::Fault { .. } | A::ReadOnly { .. } => Code::InvalidArgument,
        A::Other(..) => Code::Internal,
    };
    EngineError::new(code, e.to_string())
}

fn gpu_error(e: crate::gpu::GpuError) -> EngineError {
    EngineError::new(Code::Internal, format!("GPU: {e}"))
}

/// Fills `[offset, offset + length)` of the buffer.
pub fn fill(b: &BufferEntry, offset: u64, length: u64, pattern: &Pattern) -> Result<(), EngineError> {
    if let Some(pages) = &b.attached {
        let mut scratch = vec![0u8; SCRATCH.min(length as usize)];
        let mut pos = offset;
        while pos < offset + length {
            let n = ((offset + length - pos) as usize).min(SCRATCH);
            pattern.write(offset, pos, &mut scratch[..n]);
            pages.write(pos, &scratch[..n]).map_err(attach_error)?;
            pos += n as u64;
        }
        return Ok(());
    }
    match &b.memory {
        BufferMemory::Client => Err(EngineError::new(
            Code::Internal,
            format!("buffer {}: client memory without its pages", b.id),
        )),
        BufferMemory::Host(region) => {
            let mut scratch = vec![0u8; SCRATCH.min(length as usize)];
            let mut pos = offset;
            let end = offset + length;
            while pos < end {
                let n = ((end - pos) as usize).min(SCRATCH);
                pattern.write(offset, pos, &mut scratch[..n]);
                region
                    .write(pos as usize, &scratch[..n])
                    .map_err(|e| EngineError::new(Code::Internal, e.to_string()))?;
                pos += n as u64;
            }
            Ok(())
        }
        BufferMemory::Cuda { region, .. } => {
            let stream = Stream::new(region.gpu()).map_err(gpu_error)?;
            region
                .fill_with(&stream, offset, length, |pos, out| {
                    pattern.write(offset, pos, out)
                })
                .map_err(gpu_error)
        }
    }
}

/// Copies `len` bytes at `offset` out of the buffer.
pub fn read(b: &BufferEntry, offset: u64, len: u64) -> Result<Vec<u8>, EngineError> {
    if let Some(pages) = &b.attached {
        let mut out = vec![0u8; len as usize];
        pages.read(offset, &mut out).map_err(attach_error)?;
        return Ok(out);
    }
    match &b.memory {
        BufferMemory::Client => Err(EngineError::new(
            Code::Internal,
            format!("buffer {}: client memory without its pages", b.id),
        )),
        BufferMemory::Host(region) => region
            .to_vec(offset as usize, len as usize)
            .map_err(|e| EngineError::new(Code::Internal, e.to_string())),
        BufferMemory::Cuda { region, .. } => {
            let mut out = vec![0u8; len as usize];
            region.read(offset, &mut out).map_err(gpu_error)?;
            Ok(out)
        }
    }
}

/// Copies `dst.len()` bytes at `offset` out of the buffer into `dst` (an inline transfer's
/// gather: `poller/inline.rs`). GPU memory by a synchronous copy.
pub fn read_into(b: &BufferEntry, offset: u64, dst: &mut [u8]) -> Result<(), String> {
    if let Some(pages) = &b.attached {
        return pages.read(offset, dst).map_err(|e| e.to_string());
    }
    match &b.memory {
        BufferMemory::Client => Err(format!("buffer {}: client memory without its pages", b.id)),
        BufferMemory::Host(region) => region.read(offset as usize, dst).map_err(|e| e.to_string()),
        BufferMemory::Cuda { region, .. } => region.read(offset, dst).map_err(|e| format!("GPU: {e}")),
    }
}

/// Copies `src` into the buffer at `offset` (an inline transfer's landing). GPU memory by a
/// synchronous copy.
pub fn write_from(b: &BufferEntry, offset: u64, src: &[u8]) -> Result<(), String> {
    if let Some(pages) = &b.attached {
        return pages.write(offset, src).map_err(|e| e.to_string());
    }
    match &b.memory {
        BufferMemory::Client => Err(format!("buffer {}: client memory without its pages", b.id)),
        BufferMemory::Host(region) => region.write(offset as usize, src).map_err(|e| e.to_string()),
        BufferMemory::Cuda { region, .. } => region.write(offset, src).map_err(|e| format!("GPU: {e}")),
    }
}

/// CRC-32C of `[offset, offset + length)`.
pub fn checksum(b: &BufferEntry, offset: u64, length: u64) -> Result<u32, EngineError> {
    if let Some(pages) = &b.attached {
        let mut scratch = vec![0u8; SCRATCH.min(length as usize)];
        let (mut crc, mut pos) = (0u32, offset);
        while pos < offset + length {
            let n = ((offset + length - pos) as usize).min(SCRATCH);
            pages.read(pos, &mut scratch[..n]).map_err(attach_error)?;
            crc = crc32c::crc32c_append(crc, &scratch[..n]);
            pos += n as u64;
        }
        return Ok(crc);
    }
    match &b.memory {
        BufferMemory::Client => Err(EngineError::new(
            Code::Internal,
            format!("buffer {}: client memory without its pages", b.id),
        )),
        BufferMemory::Host(region) => {
            let mut scratch = vec![0u8; SCRATCH.min(length as usize)];
            let mut crc = 0u32;
            let mut pos = offset;
            let end = offset + length;
            while pos < end {
                let n = ((end - pos) as usize).min(SCRATCH);
                region
                    .read(pos as usize, &mut scratch[..n])
                    .map_err(|e| EngineError::new(Code::Internal, e.to_string()))?;
                crc = crc32c::crc32c_append(crc, &scratch[..n]);
                pos += n as u64;
            }
            Ok(crc)
        }
        BufferMemory::Cuda { region, .. } => {
            let stream = Stream::new(region.gpu()).map_err(gpu_error)?;
            region.crc32c(&stream, offset, length).map_err(gpu_error)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffers::{BufferRegistry, seeded_bytes};

    #[test]
    fn fill_checksum_and_ranges() {
        let reg = BufferRegistry::new("n", 1 << 30);
        let b = reg.allocate_host(3 * SCRATCH as u64 + 17, "x").unwrap();
        fill(&b, 0, b.size, &Pattern::Seed(7)).unwrap();
        let mut expect = vec![0u8; b.size as usize];
        seeded_bytes(7, 0, &mut expect);
        assert_eq!(read(&b, 0, b.size).unwrap(), expect);
        assert_eq!(checksum(&b, 0, b.size).unwrap(), crc32c::crc32c(&expect));
        // Sub-ranges of the seeded pattern depend only on position.
        let mut part = vec![0u8; 100];
        seeded_bytes(7, 5000, &mut part);
        assert_eq!(part, expect[5000..5100]);
        fill(&b, 10, 5, &Pattern::Repeat(vec![1, 2])).unwrap();
        assert_eq!(read(&b, 10, 5).unwrap(), vec![1, 2, 1, 2, 1]);
        fill(&b, 0, 3, &Pattern::Byte(9)).unwrap();
        assert_eq!(read(&b, 0, 3).unwrap(), vec![9, 9, 9]);
        assert_eq!(resolve_range(&b, 10, 0, true).unwrap(), (10, b.size - 10));
        assert!(resolve_range(&b, b.size + 1, 0, true).is_err());
        assert!(
            resolve_range(&b, 1, u64::MAX, false)
                .unwrap_err()
                .message
                .contains("overflows")
        );
        assert!(
            resolve_range(&b, 1, b.size, false)
                .unwrap_err()
                .message
                .contains("past the end")
        );
    }
}
