//! Starting the unpack of a completed receive, for host and GPU destinations, and what a
//! receive waits for before it may be consumed.

use std::sync::Arc;

use super::stage::{BatchEnd, GpuStage};
use crate::gpu::{DeviceRegion, Gpu};
use crate::net::host_copies::CopyTicket;
use crate::net::{RecvComm, Region, RequestId};
use crate::unpack::UnpackJob;

/// The memory a completed receive's bytes go to.
#[derive(Clone, Copy)]
pub enum Target<'a> {
    Host(&'a dyn Region),
    Gpu(&'a DeviceRegion),
}

/// Where a completed receive's bytes go.
#[derive(Clone, Copy)]
pub struct Dest<'a> {
    pub target: Target<'a>,
    pub offset: u64,
    pub len: u32,
    /// Eager: the receive was posted into the lane's landing slots, not into the destination,
    /// so the bytes are copied there even when the plugin received them in place (a direct
    /// receive).
    pub staged: bool,
}

/// What a completed receive waits for before it is consumed.
#[derive(Debug)]
pub enum Wait {
    /// An eager credit receive completed before its header: the destination is not known yet.
    Header,
    /// Unpacked (or nothing to unpack), with the outcome.
    Ready(Result<(), String>),
    /// In batch `batch` of GPU `gpu`'s unpack stage; `len` bytes posted.
    Gpu { gpu: usize, batch: u64, len: u32 },
    /// Host copies queued on a copy helper (`net::host_copies`): done with its ticket.
    Host(CopyTicket),
    /// As `Host`, out of the receive's own posted range (a direct receive into the lane's host
    /// landing ring, `RecvComm::landed_in_place`): the plugin's request may be consumed before
    /// the ticket is done ([`Wait::releases_early`]); the receive counts as consumed (its
    /// destination written, its slot free for a later receive) only once it is.
    Slot(CopyTicket),
}

impl Wait {
    /// Whether the plugin's request may be consumed before this wait is over: nothing of the
    /// receive is read from the plugin's memory.
    pub fn releases_early(&self) -> bool {
        matches!(self, Wait::Slot(_))
    }

    /// Whether the unpack runs on the host (at once or on a copy helper).
    pub fn on_host(&self) -> bool {
        matches!(self, Wait::Ready(_) | Wait::Host(_) | Wait::Slot(_))
    }

    /// The receive's outcome once it may be consumed (`None`: not yet). `outcome` tells how a
    /// GPU's batch ended; a batch the GPU rejected part of leaves the decision to the receive's
    /// own list (still in the ring: not consumed yet).
    pub fn outcome(
        &self,
        comm: &RecvComm,
        id: RequestId,
        outcome: impl FnOnce(usize, u64) -> Option<BatchEnd>,
    ) -> Option<Result<(), String>> {
        match self {
            Wait::Header => None,
            Wait::Ready(r) => Some(r.clone()),
            Wait::Host(ticket) | Wait::Slot(ticket) => ticket.is_done().then_some(Ok(())),
            Wait::Gpu { gpu, batch, len } => match outcome(*gpu, *batch)? {
                BatchEnd::Unpacked => Some(Ok(())),
                BatchEnd::Failed(why) => Some(Err(why)),
                BatchEnd::Rejected => Some(check_list(comm, id, *len)),
            },
        }
    }
}

/// Starts unpacking completed receive `id`: nothing to do when the plugin received in place (or
/// the chunk was sent empty), a host gather for host destinations, a push into the GPU stage's
/// unpacker for CUDA destinations (`stage` gives the stage of the destination's GPU). A staged
/// (eager) receive that the plugin received in place, into the landing slot, is copied to its
/// destination (a staging copy: synchronous for GPU memory).
pub fn start_unpack<'s>(
    comm: &RecvComm,
    id: RequestId,
    dest: Dest<'_>,
    stage: impl FnOnce(&Arc<Gpu>) -> Result<&'s mut GpuStage, String>,
) -> Wait {
    let (ring, q) = match comm.completed(id) {
        Ok(v) => v,
        Err(e) => return Wait::Ready(Err(e.to_string())),
    };
    let frags = match ring.fragments(q) {
        Ok(f) => f,
        Err(e) => return Wait::Ready(Err(e.to_string())),
    };
    // Nothing to unpack: the plugin received in place, or the chunk came empty (a cancelled
    // sender's; into a GPU landing registration nothing ever lands in place).
    if frags.is_empty() && (!dest.staged || comm.posted_on_gpu(id).unwrap_or(false)) {
        return Wait::Ready(Ok(()));
    }
    let (offset, len) = (dest.offset as usize, dest.len as usize);
    let region = match dest.target {
        Target::Host(region) => {
            let landed: u64 = frags.iter().map(|f| u64::from(f.len)).sum();
            if !frags.is_empty() && landed != u64::from(dest.len) {
                return Wait::Ready(Err(format!("chunk landed {landed} of {} bytes", dest.len)));
            }
            let r = if dest.staged {
                comm.land_host(id, region, offset, len)
            } else {
                comm.unpack_host(id)
            };
            return Wait::Ready(r.map(|_| ()).map_err(|e| e.to_string()));
        }
        Target::Gpu(region) => region,
    };
    let ordinal = region.gpu().ordinal();
    let stage = match stage(region.gpu()) {
        Ok(s) => s,
        Err(e) => return Wait::Ready(Err(e)),
    };
    // Host bounce pages (the emulation's host mode): CUDA knows no GPU of theirs. A GPU's bounce
    // pages go through the GPU's unpack even where the host can read them too (the CUDA
    // stand-in's "device" memory, which is host memory; coherent machines), as on TCPX.
    let host_bounce = ring.bounce_is_host_readable() && ring.bounce_device().is_none();
    if dest.staged && (frags.is_empty() || host_bounce) {
        // Staged in host memory (received in place into the landing slot, or into host bounce
        // pages): a synchronous copy to the GPU through the stage's host staging buffer.
        let staging = stage.host_staging(len);
        let r = match comm.land_into(id, staging) {
            Ok(n) if n == len => region.write(dest.offset, staging).map_err(|e| e.to_string()),
            Ok(n) => Err(format!("chunk landed {n} of {len} bytes")),
            Err(e) => Err(e.to_string()),
        };
        return Wait::Ready(r);
    }
    // From here the unpacker checks the list (bounds, and adding up to the posted size:
    // `exact`): on the host at `push`, or, for the ring read in place, on the GPU, reported when
    // the batch is done (`BatchEnd::Rejected`).
    let pushed = (|| -> Result<u64, String> {
        stage.reach_bounce(ring.bounce_device())?;
        let job = UnpackJob {
            frags: ring.fragment_list(q).map_err(|e| e.to_string())?,
            bounce: ring.bounce_span(frags),
            dst: region
                .subspan(dest.offset, u64::from(dest.len))
                .map_err(|e| e.to_string())?,
            exact: true,
        };
        stage.push_unpack(&job)
    })();
    match pushed {
        Ok(batch) => Wait::Gpu {
            gpu: ordinal,
            batch,
            len: dest.len,
        },
        Err(e) => Wait::Ready(Err(e)),
    }
}

/// A completed receive dropped without unpacking (an eager chunk of a refused or cancelled
/// transfer): its posted range is zeroed when it is host memory (a landing slot), so that what a
/// direct receive left there can never reach a destination through a later receive that brings
/// nothing (an emptied chunk); then it may be consumed.
pub fn discard(comm: &RecvComm, id: RequestId) -> Wait {
    // The whole posted range: `zero_posted` stops at its end.
    let _ = comm.zero_posted(id, usize::MAX);
    Wait::Ready(Ok(()))
}

/// The host's check of a completed receive's list (still in the ring: not consumed yet) against
/// the bounce buffer and the posted size, for the receives of a batch the GPU rejected part of:
/// only a receive whose own list is bad fails, named (the kernel skips only out-of-bounds
/// fragments, so the others were unpacked whole).
pub fn check_list(comm: &RecvComm, id: RequestId, len: u32) -> Result<(), String> {
    let (ring, q) = comm.completed(id).map_err(|e| format!("unpack: {e}"))?;
    let frags = ring.fragments(q).map_err(|e| format!("unpack: {e}"))?;
    let bounce_len = ring.bounce_span(frags).len();
    crate::unpack::validate_list(frags, bounce_len, u64::from(len), true)
        .map(|_| ())
        .map_err(|e| format!("unpack: {e}"))
}
