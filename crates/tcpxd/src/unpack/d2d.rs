//! The d2d unpacker: one `cuMemcpyDtoDAsync` per fragment (fragments adjacent in both the bounce
//! buffer and the destination are merged into one copy), an event per batch. What the earlier
//! C++ code used by default; here as a reference and fallback.

use std::sync::Arc;

use super::{BatchEvents, Ticket, UnpackError, UnpackJob, Unpacker, validate};
use crate::gpu::{DeviceSpan, Gpu, Stream};

const SLOTS: usize = 16;

#[derive(Debug, Clone, Copy)]
struct Piece {
    dst: DeviceSpan,
    src: DeviceSpan,
}

pub struct D2dUnpacker {
    stream: Stream,
    events: BatchEvents,
    queue: Vec<Piece>,
}

impl D2dUnpacker {
    pub fn new(gpu: &Arc<Gpu>) -> Result<D2dUnpacker, UnpackError> {
        Ok(D2dUnpacker {
            stream: Stream::new(gpu)?,
            events: BatchEvents::new(gpu, SLOTS)?,
            queue: Vec::with_capacity(16 * 2048),
        })
    }
}

impl Unpacker for D2dUnpacker {
    fn name(&self) -> &'static str {
        "d2d"
    }

    fn push(&mut self, job: &UnpackJob<'_>) -> Result<(), UnpackError> {
        validate(job)?;
        let first = self.queue.len();
        for f in job.frags.as_slice().iter().filter(|f| f.len > 0) {
            let len = u64::from(f.len);
            let src = job.bounce.sub(u64::from(f.src_off), len)?;
            let dst = job.dst.sub(f.dst_off, len)?;
            if self.queue.len() > first {
                let last = self.queue.last_mut().expect("non-empty");
                if last.src.ptr() + last.src.len() == src.ptr()
                    && last.dst.ptr() + last.dst.len() == dst.ptr()
                {
                    let grown = last.src.len() + len;
                    // Both merged ranges are contiguous inside this job's validated spans.
                    last.src = job.bounce.sub(last.src.ptr() - job.bounce.ptr(), grown)?;
                    last.dst = job.dst.sub(last.dst.ptr() - job.dst.ptr(), grown)?;
                    continue;
                }
            }
            self.queue.push(Piece { dst, src });
        }
        Ok(())
    }

    fn submit(&mut self) -> Result<Option<Ticket>, UnpackError> {
        if self.queue.is_empty() {
            return Ok(None);
        }
        self.events.reserve()?;
        for c in self.queue.drain(..) {
            self.stream.copy_span_d2d(c.dst, c.src, c.src.len())?;
        }
        Ok(Some(self.events.record(&self.stream)?))
    }

    fn is_done(&mut self, t: &Ticket) -> Result<bool, UnpackError> {
        self.events.is_done(t)
    }

    fn wait(&mut self, t: &Ticket) -> Result<(), UnpackError> {
        self.events.wait(t)
    }

    fn stream(&self) -> &Stream {
        &self.stream
    }
}
