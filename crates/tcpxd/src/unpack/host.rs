//! The host unpacker (debug fallback): each fragment is copied device → pinned host memory at
//! its destination position (so the gather happens in host memory), then every contiguous run of
//! the destination that the fragments cover is copied host → device. All copies are queued on one
//! stream, so the staging buffer is reused without host waits; an event per batch.

use std::sync::Arc;

use super::{BatchEvents, Ticket, UnpackError, UnpackJob, Unpacker, validate};
use crate::gpu::{DeviceSpan, Gpu, GpuError, PinnedRegion, Stream};

const SLOTS: usize = 16;
/// Pinned staging: a receive's destination extent must fit (receives are ≤ 4 MiB).
const STAGING: usize = 64 << 20;

#[derive(Debug, Clone, Copy)]
struct Frag {
    src_off: u64,
    len: u64,
    dst_off: u64,
}

#[derive(Debug, Clone, Copy)]
struct Job {
    bounce: DeviceSpan,
    dst: DeviceSpan,
    first: usize,
    count: usize,
    lo: u64,
    hi: u64,
}

pub struct HostUnpacker {
    stream: Stream,
    events: BatchEvents,
    staging: PinnedRegion,
    cursor: u64,
    jobs: Vec<Job>,
    frags: Vec<Frag>,
}

impl HostUnpacker {
    pub fn new(gpu: &Arc<Gpu>) -> Result<HostUnpacker, UnpackError> {
        Ok(HostUnpacker {
            stream: Stream::new(gpu)?,
            events: BatchEvents::new(gpu, SLOTS)?,
            staging: gpu.alloc_pinned(STAGING)?,
            cursor: 0,
            jobs: Vec::with_capacity(64),
            frags: Vec::with_capacity(16 * 2048),
        })
    }

    fn issue(&mut self, job: Job) -> Result<(), UnpackError> {
        let extent = job.hi - job.lo;
        if self.cursor + extent > STAGING as u64 {
            // Earlier copies out of the start of the staging buffer precede, on this stream,
            // the copies into it that follow.
            self.cursor = 0;
        }
        let base = self.cursor;
        let frags = &mut self.frags[job.first..job.first + job.count];
        for f in frags.iter() {
            let src = job.bounce.sub(f.src_off, f.len)?;
            self.stream
                .copy_span_to_pinned(&self.staging, base + f.dst_off - job.lo, src, f.len)?;
        }
        frags.sort_unstable_by_key(|f| f.dst_off);
        let mut run: Option<(u64, u64)> = None;
        for f in frags.iter() {
            run = match run {
                Some((s, e)) if f.dst_off <= e => Some((s, e.max(f.dst_off + f.len))),
                Some((s, e)) => {
                    self.stream.copy_pinned_to_span(
                        job.dst.sub(s, e - s)?,
                        &self.staging,
                        base + s - job.lo,
                        e - s,
                    )?;
                    Some((f.dst_off, f.dst_off + f.len))
                }
                None => Some((f.dst_off, f.dst_off + f.len)),
            };
        }
        if let Some((s, e)) = run {
            self.stream.copy_pinned_to_span(
                job.dst.sub(s, e - s)?,
                &self.staging,
                base + s - job.lo,
                e - s,
            )?;
        }
        self.cursor = (base + extent).next_multiple_of(256);
        Ok(())
    }
}

impl Unpacker for HostUnpacker {
    fn name(&self) -> &'static str {
        "host"
    }

    fn push(&mut self, job: &UnpackJob<'_>) -> Result<(), UnpackError> {
        validate(job)?;
        let first = self.frags.len();
        let (mut lo, mut hi) = (u64::MAX, 0u64);
        for f in job.frags.as_slice().iter().filter(|f| f.len > 0) {
            lo = lo.min(f.dst_off);
            hi = hi.max(f.dst_off + u64::from(f.len));
            self.frags.push(Frag {
                src_off: u64::from(f.src_off),
                len: u64::from(f.len),
                dst_off: f.dst_off,
            });
        }
        let count = self.frags.len() - first;
        if count == 0 {
            return Ok(());
        }
        if hi - lo > STAGING as u64 {
            self.frags.truncate(first);
            return Err(GpuError::InvalidArgument(format!(
                "the host unpacker stages at most {STAGING} bytes per receive ({} requested)",
                hi - lo
            ))
            .into());
        }
        self.jobs.push(Job {
            bounce: job.bounce,
            dst: job.dst,
            first,
            count,
            lo,
            hi,
        });
        Ok(())
    }

    fn submit(&mut self) -> Result<Option<Ticket>, UnpackError> {
        if self.jobs.is_empty() {
            return Ok(None);
        }
        self.events.reserve()?;
        let jobs = std::mem::take(&mut self.jobs);
        let result = jobs.iter().try_for_each(|j| self.issue(*j));
        self.jobs = jobs;
        self.jobs.clear();
        self.frags.clear();
        result?;
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
