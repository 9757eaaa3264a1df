//! Posting to the plugin for the poller's passes: the registration windows of a buffer on a
//! comm, the lanes' deferred sends and receives posted as the windows allow, an eager lane's
//! landing slots, and a completed receive's unpack into its buffer.

use std::collections::HashMap;
use std::sync::Arc;

use super::blocks::{RecvPost, STAGED, SendPost};
use super::lane_thread::{LaneThreads, Mem, ToLanes};
use super::{LANDING, Posted, RecvLane, RecvLaneState, SendLane, SendLaneState};
use crate::buffers::BufferEntry;
use crate::lanes::{self, Dest, GpuStage, Target, Wait, stage_for};
use crate::net::MemHandle;
use crate::net::host_copies::{HostCopies, Place};

/// Buffers are registered in overlapping windows, because `regMr` takes an `int` size: window
/// `k` starts at `k * WINDOW_STRIDE` and is `WINDOW_STRIDE + MAX_CHUNK_BYTES` long (or up to the
/// buffer's end), so every chunk (at most 4 MiB) lies inside the window its offset falls in.
pub const WINDOW_STRIDE: u64 = 1 << 30;
pub const WINDOW_LEN: u64 = WINDOW_STRIDE + crate::engine::MAX_CHUNK_BYTES as u64;

/// The registration covering `[offset, offset + len)` of a buffer on one comm (made on first
/// use) and the offset inside it.
pub(super) fn handle_for<'a>(
    handles: &'a mut HashMap<(u64, u64), MemHandle>,
    buffers: &crate::engine::idhash::IdMap<u64, Arc<BufferEntry>>,
    buffer: u64,
    offset: u64,
    register: impl FnOnce(Arc<dyn crate::net::Region>) -> Result<MemHandle, crate::net::NetError>,
) -> Result<(&'a MemHandle, u64), String> {
    let window = offset / WINDOW_STRIDE;
    let mh = match handles.entry((buffer, window)) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            let entry = buffers
                .get(&buffer)
                .ok_or_else(|| format!("buffer {buffer} vanished"))?;
            v.insert(register_window(entry, window, register)?)
        }
    };
    Ok((mh, offset - window * WINDOW_STRIDE))
}

/// [`handle_for`] with the buffer's entry at hand (the lane thread's: `lane_thread.rs`).
pub(super) fn handle_for_entry<'a>(
    handles: &'a mut HashMap<(u64, u64), MemHandle>,
    entry: &BufferEntry,
    offset: u64,
    register: impl FnOnce(Arc<dyn crate::net::Region>) -> Result<MemHandle, crate::net::NetError>,
) -> Result<(&'a MemHandle, u64), String> {
    let window = offset / WINDOW_STRIDE;
    let mh = match handles.entry((entry.id, window)) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => v.insert(register_window(entry, window, register)?),
    };
    Ok((mh, offset - window * WINDOW_STRIDE))
}

/// Registers window `window` of `entry` with `register`, under the buffer's GPU.
fn register_window(
    entry: &BufferEntry,
    window: u64,
    register: impl FnOnce(Arc<dyn crate::net::Region>) -> Result<MemHandle, crate::net::NetError>,
) -> Result<MemHandle, String> {
    let start = window * WINDOW_STRIDE;
    // The plugin registers CUDA memory in the context current on this thread.
    if let Some(gpu) = entry.gpu() {
        gpu.bind_to_thread().map_err(|e| e.to_string())?;
    }
    let len = WINDOW_LEN.min(entry.size - start);
    let whole = entry.mapped_region()?;
    let region: Arc<dyn crate::net::Region> = if start == 0 && len == entry.size {
        whole
    } else {
        Arc::new(
            crate::net::RegionWindow::new(whole, start as usize, len as usize).map_err(|e| e.to_string())?,
        )
    };
    register(region).map_err(|e| e.to_string())
}

/// Posts deferred sends in order while the plugin takes them and has fewer than `window`
/// (`send_window`) of the lane's sends in flight (a staged send once its gather is done). The
/// engine posts sends in pieces up to `gather_ahead` beyond the window: they wait here, gathered,
/// for a send to complete, so the plugin sees at most `send_window` sends per comm. Then the
/// gathers the window has reached move up in the helpers' queue (`HostCopies::hurry`, session
/// 28): the head's to `Place::Next`, the others' to `Place::Due` (the plugin would take their
/// sends at once).
#[allow(clippy::too_many_arguments)]
pub(super) fn post_sends(
    peer: crate::engine::PeerIdx,
    li: usize,
    l: &mut SendLane,
    window: usize,
    buffers: &crate::engine::idhash::IdMap<u64, Arc<BufferEntry>>,
    stages: &mut HashMap<usize, GpuStage>,
    copies: &HostCopies,
    lanes: Option<&LaneThreads>,
) -> Result<(), String> {
    let outstanding = match &mut l.state {
        SendLaneState::Ready(comm) => comm.outstanding(),
        SendLaneState::Threaded(t) => t.outstanding,
        _ => return Ok(()),
    };
    let mut outstanding = outstanding;
    while outstanding < window
        && let Some(&SendPost {
            buffer,
            offset,
            len,
            ring,
            gate,
            ref copied,
            ..
        }) = l.deferred.front()
    {
        if copied.as_ref().is_some_and(|t| !t.is_done()) {
            break;
        }
        if let Some((gpu, batch)) = gate {
            match stages.get_mut(&gpu).and_then(|s| s.gather_outcome(batch)) {
                None if stages.contains_key(&gpu) => break,
                None => return Err(format!("the gather stage of GPU {gpu} vanished")),
                Some(Err(why)) => return Err(why),
                Some(Ok(())) => {}
            }
        }
        let trace_id = match &mut l.state {
            SendLaneState::Ready(comm) => {
                let (mh, at) = if buffer == STAGED {
                    let mh = l
                        .staging
                        .handle(ring)
                        .ok_or("a staged send without its staging ring")?;
                    (mh, offset)
                } else {
                    handle_for(&mut l.handles, buffers, buffer, offset, |r| comm.register(r))?
                };
                if !lanes::post_send(comm, &mut l.tag, mh, at as usize, len).map_err(|e| e.to_string())? {
                    break;
                }
                // Dispatched by the plugin only once tested (`lanes::post_send`): tested now, so
                // it moves while the rest are posted; what this finds done, the pass reports.
                l.sent_early += lanes::test_sends(comm, || {}).map_err(|e| e.to_string())? as u32;
                outstanding = comm.outstanding();
                comm.trace_id()
            }
            SendLaneState::Threaded(t) => {
                // Handed to the lane thread, which posts it after the lane's earlier sends.
                let mem = if buffer == STAGED {
                    Mem::Staged(ring, offset)
                } else {
                    let entry = buffers
                        .get(&buffer)
                        .ok_or_else(|| format!("buffer {buffer} vanished"))?;
                    Mem::Buffer(entry.clone(), offset)
                };
                let lanes = lanes.ok_or("a threaded send lane without the lane thread")?;
                lanes.send(
                    l.gpu,
                    ToLanes::Post {
                        key: (peer, li as u32),
                        epoch: l.epoch,
                        mem,
                        len,
                    },
                );
                t.outstanding += 1;
                outstanding = t.outstanding;
                t.trace_id
            }
            _ => return Ok(()),
        };
        if buffer == STAGED {
            // Its gather is over (the k-th on this comm: `poller.gather`'s k-th); with its copy's
            // wait for a helper, copying and end unseen until now, when a helper copied it.
            let t = copied.as_ref().and_then(|t| t.times()).unwrap_or_default();
            tracing::trace!(
                target: "tcpxd::hop",
                hop = "poller.gathered",
                comm = trace_id,
                wait_us = t.wait_us,
                copy_us = t.copy_us,
                since_us = t.since_us
            );
        }
        l.deferred.pop_front();
    }
    // The head is the lane's next send; the rest the window reaches are due. In ring order, so
    // an older gather is never behind a younger one of the lane.
    let room = window.saturating_sub(outstanding);
    for (n, post) in l.deferred.iter_mut().take(room).enumerate() {
        let want = if n == 0 { Place::Next } else { Place::Due };
        if post.place > want {
            post.place = want;
            if let Some(t) = post.copied.as_ref().filter(|t| !t.is_done()) {
                copies.hurry(t, want);
            }
        }
    }
    Ok(())
}

/// Posts deferred receives in order while the plugin takes them and holds fewer than `window`
/// (`recv_window`) of the lane's receives. The engine posts receives in pieces up to
/// `scatter_ahead` beyond the window: they wait here until a receive's plugin slot comes back,
/// which for one that landed in the lane's host landing ring is as soon as it completed
/// (`lanes::RecvQueue::consume_ready`), before its scatter is over.
pub(super) fn post_recvs(
    l: &mut RecvLane,
    window: usize,
    buffers: &crate::engine::idhash::IdMap<u64, Arc<BufferEntry>>,
) -> Result<(), String> {
    let RecvLaneState::Ready(comm) = &mut l.state else {
        return Ok(());
    };
    while comm.outstanding() < window
        && let Some(&RecvPost {
            buffer,
            offset,
            len,
            scatter,
            offer,
        }) = l.deferred.front()
    {
        let (mh, at) = match (&l.landing_slots, buffer) {
            (Some(mh), LANDING) => (mh, offset),
            (None, LANDING) => return Err("credit receive without landing slots".into()),
            (_, STAGED) => (
                l.scatter
                    .landing()
                    .ok_or("a block receive without its landing ring")?,
                offset,
            ),
            _ => handle_for(&mut l.handles, buffers, buffer, offset, |r| comm.register(r))?,
        };
        let meta = Posted {
            buffer,
            offset,
            scatter,
            offer,
        };
        if !l
            .queue
            .post(comm, mh, at as usize, len, meta)
            .map_err(|e| e.to_string())?
        {
            break;
        }
        l.deferred.pop_front();
    }
    Ok(())
}

/// Bytes of a GPU landing registration: one page, which every credit receive of the lane names
/// whatever its size (a CUDA receive's posted destination is never written).
pub(super) const GPU_LANDING_BYTES: usize = 4096;

/// Makes an eager lane's landing slots on first use. With `gpu_credits` and a lane GPU: one
/// page of that GPU's memory, registered on the lane's comm with the GPU current (`regMr`
/// registers under the current GPU); every credit receive names it and lands in the GPU's bounce
/// pages, and the unpack alone decides where its bytes go. Otherwise (or if that fails, logged):
/// `credits` slots of `len` bytes of host memory, populated, registered on the lane's comm; a
/// credit receive posted into one lands in bounce pages (emulation host mode) or in the slot
/// itself (direct receives: host memory on the real plugin, `TCPXEMU_HOST_RECV=direct`), and is
/// copied to its destination once its header said where.
pub(super) fn landing_slots(
    l: &mut RecvLane,
    credits: u64,
    len: u32,
    gpu_credits: bool,
) -> Result<(), String> {
    if l.landing_slots.is_some() {
        return Ok(());
    }
    let gpu = l.lane_gpu();
    let RecvLaneState::Ready(comm) = &l.state else {
        return Err("the lane is not connected".into());
    };
    let (mh, on_gpu) = make_landing(comm, gpu, credits, len, gpu_credits)?;
    l.landing_slots = Some(mh);
    l.landing_on_gpu = on_gpu;
    Ok(())
}

/// [`landing_slots`]' registration on `comm` (the lane's GPU `gpu`): the registration and
/// whether it is GPU memory. The lane threads' receive lanes make theirs with it too.
pub(super) fn make_landing(
    comm: &crate::net::RecvComm,
    gpu: Option<u32>,
    credits: u64,
    len: u32,
    gpu_credits: bool,
) -> Result<(MemHandle, bool), String> {
    if gpu_credits && let Some(g) = gpu {
        let landing = crate::gpu::shared(g as usize)
            .and_then(|gpu| {
                let region = gpu.alloc(GPU_LANDING_BYTES)?;
                gpu.bind_to_thread()?;
                Ok(region)
            })
            .map_err(|e| e.to_string())
            .and_then(|region| comm.register(Arc::new(region)).map_err(|e| e.to_string()));
        match landing {
            Ok(mh) => return Ok((mh, true)),
            Err(why) => tracing::warn!(
                gpu = g,
                "credit receives land in host slots on this lane: a GPU landing registration failed: {why}"
            ),
        }
    }
    let bytes = credits * u64::from(len);
    let region = crate::net::HostRegion::populated(bytes as usize).map_err(|e| e.to_string())?;
    let mh = comm.register(Arc::new(region)).map_err(|e| e.to_string())?;
    Ok((mh, false))
}

/// Where a completed receive's bytes go, by buffer id.
#[derive(Debug, Clone, Copy)]
pub(super) struct Placed {
    pub buffer: u64,
    pub offset: u64,
    pub len: u32,
    /// Eager: received into the lane's landing slots (see [`Dest::staged`]).
    pub staged: bool,
}

/// [`lanes::start_unpack`] into a registered buffer (by id), the GPU's stage made on first use.
pub(super) fn start_buffer_unpack(
    comm: &crate::net::RecvComm,
    id: crate::net::RequestId,
    to: Placed,
    buffers: &crate::engine::idhash::IdMap<u64, Arc<BufferEntry>>,
    stages: &mut HashMap<usize, GpuStage>,
    unpack_impl: crate::unpack::UnpackImpl,
) -> Wait {
    let Some(entry) = buffers.get(&to.buffer) else {
        return Wait::Ready(Err(format!("buffer {} vanished", to.buffer)));
    };
    start_entry_unpack(comm, id, to, entry, stages, unpack_impl)
}

/// [`start_buffer_unpack`] with the buffer's entry at hand (the lane threads': the entry travels
/// with the receive's post).
pub(super) fn start_entry_unpack(
    comm: &crate::net::RecvComm,
    id: crate::net::RequestId,
    to: Placed,
    entry: &BufferEntry,
    stages: &mut HashMap<usize, GpuStage>,
    unpack_impl: crate::unpack::UnpackImpl,
) -> Wait {
    if entry.attached.is_some() {
        // A buffer registered by address: an eager chunk, scattered from the landing slot into
        // the client's pages (its plain receives go through the landing ring: `PostRecv`).
        let piece = [super::blocks::whole(to.offset, to.len)];
        return Wait::Ready(super::blocks::scatter_to_client(comm, id, entry, &piece, to.len));
    }
    let host;
    let target = match entry.device_region() {
        Some(region) => Target::Gpu(region),
        None => {
            host = match entry.mapped_region() {
                Ok(r) => r,
                Err(why) => return Wait::Ready(Err(why)),
            };
            Target::Host(&*host)
        }
    };
    let dest = Dest {
        target,
        offset: to.offset,
        len: to.len,
        staged: to.staged,
    };
    lanes::start_unpack(comm, id, dest, |gpu| stage_for(stages, gpu, unpack_impl))
}
