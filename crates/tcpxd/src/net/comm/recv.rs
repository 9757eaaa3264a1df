//! The receiving side: `RecvComm`, its window of 16 slots (posted or completed and not yet
//! consumed), the test and consume order, its unpack ring and the host landing of receives.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::RequestId;
use super::comm_core::{CommCore, DeviceHandleStorage, MemHandle, register, test_raw};
use crate::net::abi::{self, loadMeta, ncclNetDeviceHandle_v7_t};
use crate::net::cross_memory::{ClientCopies, ClientPages};
use crate::net::error::{NetError, NetResult};
use crate::net::host_copies::{CopyJob, CopyTicket, HostCopies, HostCopy};
use crate::net::logger;
use crate::net::memory::{MemType, Region};
use crate::net::plugin::Plugin;
use crate::net::ring::UnpackRing;

/// One copy of a scatter: `n` landed bytes at a pointer to byte `to` of the destination.
type LandedCopy = (*const u8, usize, usize);

/// What a scatter's plan hands its writer (`RecvComm::scatter_with`).
enum LandedOp {
    Copy(LandedCopy),
    /// Every copy handed over: copy them (later only when `lasting`: the sources stay readable
    /// until the receive is consumed), then zero `zero` (`n` bytes at a pointer).
    Flush {
        zero: Option<(*mut u8, usize)>,
        lasting: bool,
    },
}

struct RecvSlot {
    id: RequestId,
    raw: *mut c_void,
    q: usize,
    offset: usize,
    len: usize,
    done: bool,
    region: Arc<dyn Region>,
}

/// A completed receive: its ring slot holds the fragment list until it is consumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvCompletion {
    pub id: RequestId,
    /// The unpack-ring slot (`q`) the request took.
    pub q: usize,
    /// The posted size (`test` reports none; the engine guarantees the sender sent exactly this).
    pub len: usize,
}

/// A receive comm: its in-flight and completed-but-unconsumed requests, oldest first, the
/// device-handle storage it owns and its unpack ring.
pub struct RecvComm {
    core: Arc<CommCore>,
    _device_handle_storage: Box<DeviceHandleStorage>,
    device_handle: Option<ncclNetDeviceHandle_v7_t>,
    ring: Result<UnpackRing, String>,
    slots: VecDeque<RecvSlot>,
    next_id: u64,
    /// Ring tail: the slot the next receive takes is `tail % 16`.
    tail: u64,
    sizes_written: u64,
}

// SAFETY: as for `SendComm`.
unsafe impl Send for RecvComm {}

impl RecvComm {
    pub(super) fn new(
        core: Arc<CommCore>,
        storage: Box<DeviceHandleStorage>,
        device_handle: Option<ncclNetDeviceHandle_v7_t>,
    ) -> RecvComm {
        let ring = match &device_handle {
            Some(dh) if dh.netDeviceType == abi::NCCL_NET_DEVICE_UNPACK => {
                UnpackRing::from_device_handle(dh).map_err(|e| e.to_string())
            }
            _ => Err("the plugin returned no unpack device handle".to_string()),
        };
        RecvComm {
            core,
            _device_handle_storage: storage,
            device_handle,
            ring,
            slots: VecDeque::with_capacity(abi::MAX_REQUESTS),
            next_id: 0,
            tail: 0,
            sizes_written: 0,
        }
    }

    pub fn dev(&self) -> i32 {
        self.core.dev
    }

    /// A number naming this comm in the hop trace, as [`super::SendComm::trace_id`].
    pub fn trace_id(&self) -> usize {
        Arc::as_ptr(&self.core) as usize
    }

    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.core.plugin
    }

    /// The device handle `accept` filled.
    pub fn device_handle(&self) -> Option<&ncclNetDeviceHandle_v7_t> {
        self.device_handle.as_ref()
    }

    /// The unpack ring, or why it is not readable from the host.
    pub fn unpack_ring(&self) -> NetResult<&UnpackRing> {
        self.ring.as_ref().map_err(|e| NetError::Ring(e.clone()))
    }

    pub fn register(&self, region: Arc<dyn Region>) -> NetResult<MemHandle> {
        register(&self.core, region)
    }

    /// Requests holding a slot: posted, or completed and not yet consumed.
    pub fn outstanding(&self) -> usize {
        self.slots.len()
    }

    pub fn can_post(&self) -> bool {
        self.slots.len() < abi::MAX_REQUESTS
    }

    /// The oldest receive `test` has not reported done (the only one `test` may be called on).
    pub fn oldest_pending(&self) -> Option<RequestId> {
        self.slots.iter().find(|s| !s.done).map(|s| s.id)
    }

    /// The oldest slot holder (the only request `irecvConsumed` accepts, once done).
    pub fn oldest(&self) -> Option<RequestId> {
        self.slots.front().map(|s| s.id)
    }

    /// How many times the plugin wrote `*sizes` in `test` (TCPX never does).
    pub fn sizes_written(&self) -> u64 {
        self.sizes_written
    }

    /// Posts a receive of `len` bytes into `mh`'s region at `offset`. `Ok(None)`: not taken now.
    pub fn irecv(
        &mut self,
        mh: &MemHandle,
        offset: usize,
        len: usize,
        tag: i32,
    ) -> NetResult<Option<RequestId>> {
        if !self.can_post() {
            return Err(NetError::WindowFull {
                outstanding: self.slots.len(),
                limit: abi::MAX_REQUESTS,
            });
        }
        self.irecv_unchecked(mh, offset, len, tag)
    }

    /// [`RecvComm::irecv`] without the window check.
    pub fn irecv_unchecked(
        &mut self,
        mh: &MemHandle,
        offset: usize,
        len: usize,
        tag: i32,
    ) -> NetResult<Option<RequestId>> {
        if !Arc::ptr_eq(&mh.core, &self.core) {
            return Err(NetError::InvalidArgument(
                "the memory handle was registered on another comm".into(),
            ));
        }
        let data = mh.check_receive(offset, len)?;
        let mut data_ptr: *mut c_void = data.cast();
        let mut size = len as c_int;
        let mut tag = tag;
        let mut mhandle = mh.raw;
        let mut req: *mut c_void = std::ptr::null_mut();
        let mark = logger::mark();
        // SAFETY: one receive (n = 1) into `len` bytes inside the registered region (for CUDA
        // memory: starting inside it, the posted destination never being written: see
        // `check_receive`), which the slot keeps alive until the request is consumed.
        let rc = unsafe {
            self.core.plugin.table.irecv.expect("checked")(
                self.core.raw,
                1,
                &mut data_ptr,
                &mut size,
                &mut tag,
                &mut mhandle,
                &mut req,
            )
        };
        self.core.plugin.check(rc, "irecv", mark)?;
        if req.is_null() {
            return Ok(None);
        }
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let q = (self.tail % abi::MAX_REQUESTS as u64) as usize;
        self.tail += 1;
        self.slots.push_back(RecvSlot {
            id,
            raw: req,
            q,
            offset,
            len,
            done: false,
            region: mh.region.clone(),
        });
        Ok(Some(id))
    }

    /// Tests the oldest pending receive. On completion its fragments are in the ring.
    pub fn test(&mut self, id: RequestId) -> NetResult<Option<RecvCompletion>> {
        if self.oldest_pending() != Some(id) {
            return Err(self.misordered(id, "the oldest pending receive"));
        }
        self.test_unchecked(id)
    }

    fn misordered(&self, id: RequestId, expected: &'static str) -> NetError {
        if self.slots.iter().any(|s| s.id == id) {
            NetError::OutOfOrder { id: id.0, expected }
        } else {
            NetError::UnknownRequest { id: id.0 }
        }
    }

    fn position(&self, id: RequestId) -> NetResult<usize> {
        self.slots
            .iter()
            .position(|s| s.id == id)
            .ok_or(NetError::UnknownRequest { id: id.0 })
    }

    /// [`RecvComm::test`] on any slot holder.
    pub fn test_unchecked(&mut self, id: RequestId) -> NetResult<Option<RecvCompletion>> {
        let pos = self.position(id)?;
        let (done, wrote) = test_raw(&self.core, self.slots[pos].raw)?;
        self.sizes_written += u64::from(wrote);
        if !done {
            return Ok(None);
        }
        let slot = &mut self.slots[pos];
        slot.done = true;
        Ok(Some(RecvCompletion {
            id,
            q: slot.q,
            len: slot.len,
        }))
    }

    /// The fragment list of a completed receive (empty when the plugin received in place).
    pub fn fragments(&self, id: RequestId) -> NetResult<&[loadMeta]> {
        let slot = &self.slots[self.position(id)?];
        if !slot.done {
            return Err(NetError::OutOfOrder {
                id: id.0,
                expected: "a completed receive",
            });
        }
        self.unpack_ring()?.fragments(slot.q)
    }

    /// The completed receive's ring slot, destination and posted size, with the ring.
    pub fn completed(&self, id: RequestId) -> NetResult<(&UnpackRing, usize)> {
        let slot = &self.slots[self.position(id)?];
        if !slot.done {
            return Err(NetError::OutOfOrder {
                id: id.0,
                expected: "a completed receive",
            });
        }
        Ok((self.unpack_ring()?, slot.q))
    }

    /// Whether a receive was posted into CUDA memory (a GPU landing registration: its bytes are
    /// only ever in the bounce pages, never in the posted range).
    pub fn posted_on_gpu(&self, id: RequestId) -> NetResult<bool> {
        Ok(self.slots[self.position(id)?].region.mem_type() == MemType::Cuda)
    }

    /// Host unpack of a completed receive: gathers its fragments from a host bounce buffer into
    /// its destination. Returns the bytes copied (0 when the plugin received in place).
    pub fn unpack_host(&self, id: RequestId) -> NetResult<usize> {
        let slot = &self.slots[self.position(id)?];
        if !slot.done {
            return Err(NetError::OutOfOrder {
                id: id.0,
                expected: "a completed receive",
            });
        }
        let ring = self.unpack_ring()?;
        if ring.count(slot.q)? == 0 {
            return Ok(0);
        }
        if slot.region.mem_type() != MemType::Host {
            return Err(NetError::Ring(
                "the host unpacker cannot write into GPU memory".into(),
            ));
        }
        // SAFETY: the destination is the request's own posted range inside its host region, which
        // the slot keeps alive; the plugin finished writing (test reported done).
        unsafe { ring.gather_host(slot.q, slot.region.as_ptr().add(slot.offset), slot.len) }
    }

    /// Eager landing on the host: copies a completed receive's `len` bytes to `dst` at `dst_off`
    /// (a range the caller validated), wherever the plugin put them: gathered from the bounce
    /// pages of its fragment list, or, for a direct receive (no fragments), from the posted
    /// range itself, which is then zeroed so that a later receive that brings nothing (an
    /// emptied chunk) can never hand these bytes on. Returns the bytes copied.
    pub fn land_host(&self, id: RequestId, dst: &dyn Region, dst_off: usize, len: usize) -> NetResult<usize> {
        if dst.mem_type() != MemType::Host {
            return Err(NetError::Ring("land_host needs a host destination".into()));
        }
        if dst_off.checked_add(len).is_none_or(|end| end > dst.len()) {
            return Err(NetError::InvalidArgument(format!(
                "landing {dst_off}+{len} is outside the {}-byte destination",
                dst.len()
            )));
        }
        // SAFETY: `dst_off + len` lies inside the caller's host region (checked above), which
        // nothing else touches while the receive lands, and does not overlap the posted range
        // (the landing slots are another region).
        let dst = unsafe { std::slice::from_raw_parts_mut(dst.as_ptr().add(dst_off), len) };
        self.land_into(id, dst)
    }

    /// As [`RecvComm::land_host`], into a Rust buffer (`dst.len()` bytes): a host staging copy on
    /// the way to GPU memory. Returns the bytes copied.
    pub fn land_into(&self, id: RequestId, dst: &mut [u8]) -> NetResult<usize> {
        let slot = self.completed_slot(id)?;
        let ring = self.unpack_ring()?;
        let len = dst.len();
        if ring.count(slot.q)? > 0 {
            if !ring.bounce_is_host_readable() {
                return self.gather_device(slot.q, dst);
            }
            // SAFETY: `dst` is an exclusive Rust slice of `len` bytes; the plugin finished writing.
            return unsafe { ring.gather_host(slot.q, dst.as_mut_ptr(), len) };
        }
        self.with_direct(slot, len, |src| {
            dst.copy_from_slice(src);
            Ok(())
        })?;
        Ok(len)
    }

    /// Copies completed receive slot `q`'s fragments out of the GPU's bounce pages into `dst`
    /// (host memory), one device-to-host copy per run of fragments adjacent in both, each
    /// bounds-checked first: a host destination's chunk that came by a credit receive landing in
    /// GPU memory (slower than the plugin's own host receive; docs/ARCHITECTURE.md, "Credits on GPU lanes"). Returns the
    /// bytes copied.
    fn gather_device(&self, q: usize, dst: &mut [u8]) -> NetResult<usize> {
        let ring = self.unpack_ring()?;
        let ordinal = ring.bounce_device().ok_or_else(|| {
            NetError::Ring("the bounce buffer is neither host memory nor GPU memory CUDA knows".into())
        })?;
        let gpu = crate::gpu::shared(ordinal).map_err(|e| NetError::Ring(format!("GPU {ordinal}: {e}")))?;
        let base = ring.bounce_ptr() as u64;
        let mut total = 0usize;
        // Runs of fragments adjacent on both sides go as one copy.
        let mut run: Option<(u64, u64, u64)> = None;
        let copy = |(src, at, len): (u64, u64, u64), dst: &mut [u8]| {
            gpu.read_device(base + src, &mut dst[at as usize..][..len as usize])
                .map_err(|e| NetError::Ring(format!("copying fragments out of GPU bounce pages: {e}")))
        };
        for f in ring.fragments(q)? {
            let end = f.dst_off.checked_add(u64::from(f.len));
            if end.is_none_or(|e| e > dst.len() as u64) {
                return Err(NetError::Ring(format!(
                    "fragment {}+{} lands outside the {}-byte chunk (sender sent more than was posted)",
                    f.dst_off,
                    f.len,
                    dst.len()
                )));
            }
            let (src, at, len) = (u64::from(f.src_off), f.dst_off, u64::from(f.len));
            run = match run {
                Some((s, a, l)) if s + l == src && a + l == at => Some((s, a, l + len)),
                Some(r) => {
                    copy(r, dst)?;
                    Some((src, at, len))
                }
                None => Some((src, at, len)),
            };
            total += f.len as usize;
        }
        if let Some(r) = run {
            copy(r, dst)?;
        }
        Ok(total)
    }

    /// Host scatter of a completed receive of a block chunk: its `bytes` bytes to the pieces of
    /// `segs` (offsets in `dst`, in wire order), wherever the plugin put them: gathered from the
    /// host bounce pages of its fragment list (which must add up to `bytes`), or, for a direct
    /// receive (no fragments), from the posted range itself, which is then zeroed (as in
    /// [`RecvComm::land_host`]). Everything is checked before the first byte is written.
    /// Returns the bytes copied, once they are.
    pub fn scatter_landed(
        &self,
        id: RequestId,
        segs: &[crate::engine::blocks::Segment],
        bytes: u32,
        dst: &dyn Region,
        copies: &HostCopies,
    ) -> NetResult<u64> {
        self.scatter_host(id, segs, bytes, dst, None, copies)
            .map(|(n, _)| n)
    }

    /// [`RecvComm::scatter_landed`] queued on a copy helper ([`HostCopies::queue`]): returns
    /// the bytes to copy and, unless they were copied at once, the ticket to wait for. The
    /// receive must not be consumed (its bounce pages or landing slot reused) before the ticket
    /// is done, nor the comm closed before [`HostCopies::quiesce`]. `dst` is held by the job.
    pub fn scatter_landed_queued(
        &self,
        id: RequestId,
        segs: &[crate::engine::blocks::Segment],
        bytes: u32,
        dst: &Arc<dyn Region>,
        copies: &HostCopies,
    ) -> NetResult<(u64, Option<CopyTicket>)> {
        self.scatter_host(id, segs, bytes, &**dst, Some(dst), copies)
    }

    /// The host scatters: copied at once (`queue` None), or queued as one job holding `queue`
    /// (the destination) and the posted range's region.
    fn scatter_host(
        &self,
        id: RequestId,
        segs: &[crate::engine::blocks::Segment],
        bytes: u32,
        dst: &dyn Region,
        queue: Option<&Arc<dyn Region>>,
        copies: &HostCopies,
    ) -> NetResult<(u64, Option<CopyTicket>)> {
        if dst.mem_type() != MemType::Host {
            return Err(NetError::Ring("a host scatter needs a host destination".into()));
        }
        let to = dst.as_ptr();
        let mut planned: Vec<HostCopy> = Vec::with_capacity(segs.len() + 4);
        let mut ticket = None;
        let slot_region = self.completed_slot(id)?.region.clone();
        let copied = self.scatter_with(id, segs, bytes, dst.len() as u64, &mut |op| {
            match op {
                LandedOp::Copy((from, t, n)) => {
                    // SAFETY: `scatter_ops` checked `t..t + n` inside `dst`.
                    let to = unsafe { to.add(t) };
                    planned.push(HostCopy { from, to, n });
                }
                LandedOp::Flush { zero, lasting } => match queue {
                    Some(dst) if lasting => {
                        let job = CopyJob {
                            copies: std::mem::take(&mut planned),
                            zero,
                            // The destination buffer's blocks: nobody reads them soon.
                            cold_targets: true,
                            keep: vec![dst.clone(), slot_region.clone()],
                        };
                        // SAFETY: every target lies inside `dst`, a host region the job holds,
                        // whose pieces are this chunk's alone (the engine's plan; distinct per
                        // chunk); every source is landed bytes in the bounce pages or the
                        // posted range (held by the job), which the plugin does not rewrite
                        // before the receive is consumed, after the ticket is done (the
                        // caller's contract); `zero` is the posted range, written by nothing
                        // else until then.
                        ticket = unsafe { copies.queue(job) };
                    }
                    _ => {
                        // SAFETY: as above, and `copy_all` returns once all are copied, before
                        // a temporary source (`lasting` false) is dropped.
                        unsafe { copies.copy_all(&planned) };
                        if let Some((at, n)) = zero {
                            // SAFETY: the posted range (see `scatter_with`), no borrow of it
                            // alive.
                            unsafe { std::ptr::write_bytes(at, 0, n) };
                        }
                    }
                },
            }
            Ok(())
        })?;
        Ok((copied, ticket))
    }

    /// [`RecvComm::scatter_landed`] into a client's pages (a buffer registered by address,
    /// `dst_len` bytes at `pages`), each piece written by `process_vm_writev` straight from
    /// where it landed. The table and the fragments are checked before the first byte is
    /// written; a failure of the client's process (gone, its memory unmapped) stops the copy
    /// there and is returned.
    pub fn scatter_landed_to_client(
        &self,
        id: RequestId,
        segs: &[crate::engine::blocks::Segment],
        bytes: u32,
        pages: ClientPages,
        dst_len: u64,
    ) -> NetResult<u64> {
        let mut w = ClientCopies::into_client(pages);
        self.scatter_with(id, segs, bytes, dst_len, &mut |op| {
            match op {
                // SAFETY: `from` is `n` readable landed bytes that nothing writes until
                // `scatter_with` has flushed (see there); the kernel checks the client's range.
                LandedOp::Copy((from, t, n)) => unsafe { w.push(from.cast_mut(), t as u64, n) },
                LandedOp::Flush { zero, .. } => {
                    let r = w.flush();
                    if let Some((at, n)) = zero {
                        // SAFETY: the posted range (see `scatter_with`), no borrow of it alive.
                        unsafe { std::ptr::write_bytes(at, 0, n) };
                    }
                    r
                }
            }
            .map_err(|e| format!("into the client's pages: {e}"))
        })
    }

    /// The scatter's checks and copy plan; `write(Copy((from, to, n)))` puts `n` landed bytes at
    /// `from` at byte `to` of the `dst_len`-byte destination, then `write(Flush { .. })` says
    /// every copy is planned: the writer copies (at once, or later when `lasting`: the sources
    /// stay readable until the receive is consumed) and then zeroes `zero` (a direct receive's
    /// posted range) — the writer's job once `Flush` is handed over, whatever it returns. The
    /// first error `write` returns stops the copies and is returned.
    fn scatter_with(
        &self,
        id: RequestId,
        segs: &[crate::engine::blocks::Segment],
        bytes: u32,
        dst_len: u64,
        write: &mut dyn FnMut(LandedOp) -> Result<(), String>,
    ) -> NetResult<u64> {
        use crate::net::blocks::scatter_ops;
        let slot = self.completed_slot(id)?;
        let ring = self.unpack_ring()?;
        let bad = |e: crate::net::blocks::BlockCopyError| NetError::Ring(format!("scatter: {e}"));
        let mut failed: Option<String> = None;
        let mut copy = |from: *const u8, t: usize, n: usize| {
            if failed.is_none()
                && let Err(e) = write(LandedOp::Copy((from, t, n)))
            {
                failed = Some(e);
            }
        };
        if ring.count(slot.q)? > 0 && !ring.bounce_is_host_readable() {
            // GPU bounce pages (a credit receive landing in GPU memory): copied out whole first.
            let mut landed = vec![0u8; bytes as usize];
            let n = self.gather_device(slot.q, &mut landed)?;
            if n != bytes as usize {
                return Err(NetError::Ring(format!(
                    "the fragments add up to {n} bytes, the chunk is {bytes}"
                )));
            }
            let whole = [loadMeta {
                src_off: 0,
                len: bytes,
                dst_off: 0,
            }];
            let from = landed.as_ptr();
            let copied = scatter_ops(&whole, u64::from(bytes), segs, bytes, dst_len, |f, t, n| {
                // SAFETY: `scatter_ops` checked the source inside `landed`, alive until return.
                copy(unsafe { from.add(f) }, t, n)
            })
            .map_err(bad)?;
            let flush = LandedOp::Flush {
                zero: None,
                lasting: false,
            };
            let failed = failed.or_else(|| write(flush).err());
            return match failed {
                Some(e) => Err(NetError::Ring(format!("scatter {e}"))),
                None => Ok(copied),
            };
        }
        if ring.count(slot.q)? > 0 {
            let frags = ring.fragments(slot.q)?;
            let landed: u64 = frags.iter().map(|f| u64::from(f.len)).sum();
            if landed != u64::from(bytes) {
                return Err(NetError::Ring(format!(
                    "the fragments add up to {landed} bytes, the chunk is {bytes}"
                )));
            }
            // The ABI does not size the bounce buffer: the furthest published fragment ends
            // inside it.
            let bounce_len = frags
                .iter()
                .map(|f| u64::from(f.src_off) + u64::from(f.len))
                .max()
                .unwrap_or(0);
            let from = ring.bounce_ptr();
            let copied = scatter_ops(frags, bounce_len, segs, bytes, dst_len, |f, t, n| {
                // SAFETY: `scatter_ops` checked the source inside the fragments the plugin
                // published (inside its live host bounce buffer, not rewritten before the
                // request is consumed).
                copy(unsafe { from.add(f) }, t, n)
            })
            .map_err(bad)?;
            let flush = LandedOp::Flush {
                zero: None,
                lasting: true,
            };
            let failed = failed.or_else(|| write(flush).err());
            return match failed {
                Some(e) => Err(NetError::Ring(format!("scatter {e}"))),
                None => Ok(copied),
            };
        }
        if bytes as usize > slot.len || slot.region.mem_type() != MemType::Host {
            return Err(NetError::Ring(format!(
                "a {bytes}-byte chunk cannot come from a {}-byte {:?} receive",
                slot.len,
                slot.region.mem_type()
            )));
        }
        // SAFETY: the posted range lies in the slot's host region (checked at posting), alive
        // while the slot is held.
        let from = unsafe { slot.region.as_ptr().add(slot.offset) };
        let whole = [loadMeta {
            src_off: 0,
            len: bytes,
            dst_off: 0,
        }];
        let planned = scatter_ops(&whole, u64::from(bytes), segs, bytes, dst_len, |f, t, n| {
            // SAFETY: the source lies in the posted range, which the plugin no longer writes
            // (`test` reported the receive done).
            copy(unsafe { from.add(f) }.cast_const(), t, n)
        });
        // Zeroed whatever happens, so that no later receive can hand these bytes on: by the
        // writer once it has copied them out (`Flush`), else here.
        let zero_here = || {
            // SAFETY: the posted range, as above; no borrow of it is alive.
            unsafe { std::ptr::write_bytes(from, 0, bytes as usize) }
        };
        match (planned, failed.take()) {
            (Ok(copied), None) => {
                let flush = LandedOp::Flush {
                    zero: Some((from, bytes as usize)),
                    lasting: true,
                };
                match write(flush) {
                    Err(e) => Err(NetError::Ring(format!("scatter {e}"))),
                    Ok(()) => Ok(copied),
                }
            }
            (Ok(_), Some(e)) => {
                zero_here();
                Err(NetError::Ring(format!("scatter {e}")))
            }
            (Err(e), _) => {
                zero_here();
                Err(bad(e))
            }
        }
    }

    /// Zeroes the first `len` bytes of a completed receive's posted range when it is host memory
    /// (a landing slot whose chunk is dropped without being scattered or landed): what a direct
    /// receive left there can never be handed on by a later receive that brings nothing.
    pub fn zero_posted(&self, id: RequestId, len: usize) -> NetResult<()> {
        let slot = self.completed_slot(id)?;
        if slot.region.mem_type() != MemType::Host {
            return Ok(());
        }
        // SAFETY: at most the posted range (inside the slot's live host region, checked at
        // posting); `test` reported the receive done, so the plugin no longer writes it.
        unsafe { std::ptr::write_bytes(slot.region.as_ptr().add(slot.offset), 0, len.min(slot.len)) };
        Ok(())
    }

    /// Whether completed receive `id` holds its bytes in its own posted range of host memory
    /// (a direct receive: no fragments in the plugin's bounce pages), so that nothing of it is
    /// read from the plugin's memory: it may be consumed (`irecvConsumed`, its request slot
    /// given back) while its posted range is still being copied out, which the plugin does
    /// not write again until a receive is posted there.
    pub fn landed_in_place(&self, id: RequestId) -> NetResult<bool> {
        let slot = self.completed_slot(id)?;
        Ok(slot.region.mem_type() == MemType::Host && self.unpack_ring()?.count(slot.q)? == 0)
    }

    fn completed_slot(&self, id: RequestId) -> NetResult<&RecvSlot> {
        let slot = &self.slots[self.position(id)?];
        if !slot.done {
            return Err(NetError::OutOfOrder {
                id: id.0,
                expected: "a completed receive",
            });
        }
        Ok(slot)
    }

    fn with_direct(
        &self,
        slot: &RecvSlot,
        len: usize,
        f: impl FnOnce(&[u8]) -> Result<(), String>,
    ) -> NetResult<()> {
        if len > slot.len {
            return Err(NetError::InvalidArgument(format!(
                "{len} bytes asked of a {}-byte receive",
                slot.len
            )));
        }
        if slot.region.mem_type() != MemType::Host {
            return Err(NetError::Ring("the posted range is not host memory".into()));
        }
        // SAFETY: the posted range (`slot.offset`, at least `len` bytes) lies in the slot's host
        // region, which the slot keeps alive; `test` reported the receive done, so the plugin no
        // longer writes it, and nothing else does until the request is consumed.
        let src = unsafe { std::slice::from_raw_parts(slot.region.as_ptr().add(slot.offset), len) };
        f(src).map_err(NetError::Ring)?;
        // SAFETY: as above; the borrow `src` ended with `f`.
        unsafe { std::ptr::write_bytes(slot.region.as_ptr().add(slot.offset), 0, len) };
        Ok(())
    }

    /// Returns the oldest completed receive's pages to the plugin (`irecvConsumed`), freeing its
    /// slot. Call only after its unpack has finished.
    pub fn consume(&mut self, id: RequestId) -> NetResult<()> {
        match self.slots.front() {
            Some(s) if s.id == id && s.done => self.consume_unchecked(id),
            _ => Err(self.misordered(id, "the oldest completed receive")),
        }
    }

    /// [`RecvComm::consume`] on any slot holder.
    pub fn consume_unchecked(&mut self, id: RequestId) -> NetResult<()> {
        let pos = self.position(id)?;
        let mark = logger::mark();
        // SAFETY: `raw` is a live request of this comm (its slot is held).
        let rc = unsafe {
            self.core.plugin.table.irecvConsumed.expect("checked")(self.core.raw, 1, self.slots[pos].raw)
        };
        self.core.plugin.check(rc, "irecvConsumed", mark)?;
        self.slots.remove(pos);
        Ok(())
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        let storage = std::mem::replace(&mut self._device_handle_storage, DeviceHandleStorage::zeroed());
        let regions = self
            .slots
            .drain(..)
            .map(|s| Box::new(s.region) as Box<dyn std::any::Any + Send>);
        let items: Vec<Box<dyn std::any::Any + Send>> = regions
            .chain(std::iter::once(Box::new(storage) as Box<dyn std::any::Any + Send>))
            .collect();
        self.core.keep_until_closed(items);
    }
}
