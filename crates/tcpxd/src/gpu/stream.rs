//! Streams and events, created once and reused (creating them per chunk was the old code's 100x
//! slowdown).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys;

use super::Gpu;
use super::error::{GpuError, GpuResult, check};
use super::memory::{DeviceRegion, DeviceSpan, PinnedRegion};

/// A non-blocking CUDA stream, destroyed on drop.
pub struct Stream {
    gpu: Arc<Gpu>,
    raw: sys::CUstream,
}

// SAFETY: a stream handle may be used from any thread; the context is bound before each call.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises operations on one stream.
unsafe impl Sync for Stream {}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("raw", &self.raw).finish()
    }
}

impl Stream {
    /// Creates a stream that does not synchronise with the legacy default stream.
    pub fn new(gpu: &Arc<Gpu>) -> GpuResult<Stream> {
        gpu.bind_to_thread()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: writes one stream handle; destroyed in Drop.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream {
            gpu: gpu.clone(),
            raw,
        })
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Blocks until everything queued on the stream has finished.
    pub fn synchronize(&self) -> GpuResult<()> {
        self.gpu.bind_to_thread()?;
        // SAFETY: a live stream.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }

    /// Non-blocking: has everything queued on the stream finished? (An error of the stream's
    /// work, such as a faulted kernel, comes back as the error.)
    pub fn is_idle(&self) -> GpuResult<bool> {
        self.gpu.bind_to_thread()?;
        // SAFETY: a live stream.
        match unsafe { sys::cuStreamQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => check("cuStreamQuery", code).map(|_| false),
        }
    }

    /// Records `event` after the work queued so far.
    pub fn record(&self, event: &Event) -> GpuResult<()> {
        self.gpu.bind_to_thread()?;
        // SAFETY: live event and stream of the same context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(event.raw, self.raw)
        })
    }

    /// Makes later work on this stream wait for `event` (no host blocking).
    pub fn wait(&self, event: &Event) -> GpuResult<()> {
        self.gpu.bind_to_thread()?;
        // SAFETY: live event and stream.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw, 0)
        })
    }

    /// Asynchronous device-to-device copy between raw spans.
    pub fn copy_span_d2d(&self, dst: DeviceSpan, src: DeviceSpan, len: u64) -> GpuResult<()> {
        if len > dst.len() || len > src.len() {
            return Err(GpuError::InvalidArgument(format!(
                "copy of {len} bytes from a {}-byte span into a {}-byte span",
                src.len(),
                dst.len()
            )));
        }
        self.gpu.bind_to_thread()?;
        // SAFETY: both spans are device memory valid for `len` bytes until the work completes
        // (the spans' constructors demand it).
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.ptr(), src.ptr(), len as usize, self.raw)
        })
    }

    /// Asynchronous copy host (pinned) → device.
    pub fn copy_h2d(
        &self,
        dst: &DeviceRegion,
        dst_off: u64,
        src: &PinnedRegion,
        src_off: u64,
        len: u64,
    ) -> GpuResult<()> {
        src.check(src_off, len)?;
        self.copy_pinned_to_span(dst.subspan(dst_off, len)?, src, src_off, len)
    }

    /// Asynchronous copy device → host (pinned).
    pub fn copy_d2h(
        &self,
        dst: &PinnedRegion,
        dst_off: u64,
        src: &DeviceRegion,
        src_off: u64,
        len: u64,
    ) -> GpuResult<()> {
        dst.check(dst_off, len)?;
        self.copy_span_to_pinned(dst, dst_off, src.subspan(src_off, len)?, len)
    }

    /// Asynchronous copy of pinned bytes `src[src_off..+len]` to a device span.
    pub fn copy_pinned_to_span(
        &self,
        dst: DeviceSpan,
        src: &PinnedRegion,
        src_off: u64,
        len: u64,
    ) -> GpuResult<()> {
        src.check(src_off, len)?;
        if len > dst.len() {
            return Err(GpuError::InvalidArgument(format!(
                "copy of {len} bytes into a {}-byte span",
                dst.len()
            )));
        }
        self.gpu.bind_to_thread()?;
        // SAFETY: the source is inside a live pinned allocation (checked), which is freed with
        // cuMemFreeHost, a call that waits for the device; the destination span is valid device
        // memory by its constructor's contract.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.ptr(),
                src.as_slice().as_ptr().add(src_off as usize).cast(),
                len as usize,
                self.raw,
            )
        })
    }

    /// Asynchronous copy of a device span into pinned bytes `dst[dst_off..+len]`.
    pub fn copy_span_to_pinned(
        &self,
        dst: &PinnedRegion,
        dst_off: u64,
        src: DeviceSpan,
        len: u64,
    ) -> GpuResult<()> {
        dst.check(dst_off, len)?;
        if len > src.len() {
            return Err(GpuError::InvalidArgument(format!(
                "copy of {len} bytes out of a {}-byte span",
                src.len()
            )));
        }
        self.gpu.bind_to_thread()?;
        // SAFETY: as in `copy_pinned_to_span`, in the other direction; the host bytes are only
        // read by the host after the caller synchronised with this copy.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_slice().as_ptr().add(dst_off as usize) as *mut std::ffi::c_void,
                src.ptr(),
                len as usize,
                self.raw,
            )
        })
    }

    /// Asynchronous copy device → device.
    pub fn copy_d2d(
        &self,
        dst: &DeviceRegion,
        dst_off: u64,
        src: &DeviceRegion,
        src_off: u64,
        len: u64,
    ) -> GpuResult<()> {
        self.copy_span_d2d(dst.subspan(dst_off, len)?, src.subspan(src_off, len)?, len)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.gpu.bind_to_thread().is_ok() {
            // SAFETY: this value's own stream, destroyed once (pending work still completes).
            let code = unsafe { sys::cuStreamDestroy_v2(self.raw) };
            if let Err(e) = check("cuStreamDestroy", code) {
                tracing::warn!("{e}");
            }
        }
    }
}

/// A CUDA event. Without timing (the default) it is cheap to record and query.
pub struct Event {
    gpu: Arc<Gpu>,
    raw: sys::CUevent,
}

// SAFETY: an event handle may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above; queries and records are thread-safe in the driver.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").field("raw", &self.raw).finish()
    }
}

impl Event {
    /// An event for completion only (`CU_EVENT_DISABLE_TIMING`).
    pub fn new(gpu: &Arc<Gpu>) -> GpuResult<Event> {
        Self::with_flags(gpu, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    }

    /// An event that can time ([`Event::elapsed_ms`]).
    pub fn timing(gpu: &Arc<Gpu>) -> GpuResult<Event> {
        Self::with_flags(gpu, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
    }

    fn with_flags(gpu: &Arc<Gpu>, flags: u32) -> GpuResult<Event> {
        gpu.bind_to_thread()?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; destroyed in Drop.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, flags) })?;
        Ok(Event {
            gpu: gpu.clone(),
            raw,
        })
    }

    /// Non-blocking: has the work before the last record finished? (An event never recorded
    /// counts as done.)
    pub fn is_done(&self) -> GpuResult<bool> {
        self.gpu.bind_to_thread()?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => check("cuEventQuery", code).map(|_| false),
        }
    }

    /// Blocks until the recorded work has finished.
    pub fn synchronize(&self) -> GpuResult<()> {
        self.gpu.bind_to_thread()?;
        // SAFETY: a live event.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.raw) })
    }

    /// Milliseconds between this event and `end` (both timing events, both completed).
    pub fn elapsed_ms(&self, end: &Event) -> GpuResult<f32> {
        self.gpu.bind_to_thread()?;
        let mut ms = 0f32;
        // SAFETY: writes one float; live events.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime(&mut ms, self.raw, end.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.gpu.bind_to_thread().is_ok() {
            // SAFETY: this value's own event, destroyed once.
            let code = unsafe { sys::cuEventDestroy_v2(self.raw) };
            if let Err(e) = check("cuEventDestroy", code) {
                tracing::warn!("{e}");
            }
        }
    }
}

/// Streams created once at start-up and handed out round-robin.
#[derive(Debug)]
pub struct StreamPool {
    streams: Vec<Stream>,
    next: AtomicUsize,
}

impl StreamPool {
    pub fn new(gpu: &Arc<Gpu>, n: usize) -> GpuResult<StreamPool> {
        let streams = (0..n.max(1))
            .map(|_| Stream::new(gpu))
            .collect::<GpuResult<Vec<_>>>()?;
        Ok(StreamPool {
            streams,
            next: AtomicUsize::new(0),
        })
    }

    /// The next stream, round-robin.
    pub fn next(&self) -> &Stream {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        &self.streams[i]
    }

    /// Stream `i` (modulo the pool's size): a fixed stream per lane, say.
    pub fn get(&self, i: usize) -> &Stream {
        &self.streams[i % self.streams.len()]
    }

    pub fn len(&self) -> usize {
        self.streams.len()
    }

    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }
}

/// Completion events, created up front and recycled: `take` one per batch, record it, query it
/// with [`Event::is_done`], `put` it back once done. Running dry creates more (logged).
#[derive(Debug)]
pub struct EventPool {
    gpu: Arc<Gpu>,
    free: Vec<Event>,
    created: usize,
}

impl EventPool {
    pub fn new(gpu: &Arc<Gpu>, n: usize) -> GpuResult<EventPool> {
        let free = (0..n).map(|_| Event::new(gpu)).collect::<GpuResult<Vec<_>>>()?;
        Ok(EventPool {
            gpu: gpu.clone(),
            created: free.len(),
            free,
        })
    }

    pub fn take(&mut self) -> GpuResult<Event> {
        if let Some(e) = self.free.pop() {
            return Ok(e);
        }
        self.created += 1;
        tracing::debug!(
            created = self.created,
            "event pool ran dry; creating another event"
        );
        Event::new(&self.gpu)
    }

    pub fn put(&mut self, e: Event) {
        self.free.push(e);
    }

    /// Events created so far (the pool's high-water mark).
    pub fn created(&self) -> usize {
        self.created
    }
}
