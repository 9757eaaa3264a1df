//! The table's data-path entries: memory registration (`regMr`, `deregMr`, `getDeviceMr`) and
//! requests (`isend`, `irecv`, `iflush`, `test`, `irecvConsumed`), each behind `guard`.

use super::{CommKind, MR_MAGIC, Mr, REQ_MAGIC, ReqSlot, cfg, comm_ref, cuda_ctx, guard, mr_ref, ok_or};
use crate::abi::{self, MAX_REQUESTS, ncclResult_t};
use crate::config::{Bounce, Config};
use crate::cuda::{self, Ctx};
use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::Arc;

pub(super) unsafe extern "C" fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    mtype: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    guard("regMr", || {
        ok_or((|| {
            let cfg = cfg()?;
            // SAFETY: by contract a comm pointer from connect/accept.
            unsafe { comm_ref(comm, "regMr") }?;
            if mhandle.is_null() || size < 0 {
                warn!("tcpxemu: regMr: NULL mhandle or negative size {size}");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            let ctx = match mtype {
                abi::NCCL_PTR_HOST => None,
                abi::NCCL_PTR_CUDA => Some(reg_cuda(cfg, data, size)?),
                other => {
                    warn!("tcpxemu: regMr: unsupported memory type {other:#x}");
                    return Err(abi::NCCL_INVALID_ARGUMENT);
                }
            };
            let m = Box::into_raw(Box::new(Mr {
                magic: MR_MAGIC,
                mtype,
                base: data as usize,
                size: size as usize,
                ctx,
            }));
            crate::live_mrs(size as usize, 1);
            // SAFETY: non-NULL out-parameter.
            unsafe { *mhandle = m.cast() };
            Ok(())
        })())
    })
}

/// `regMr(NCCL_PTR_CUDA)`: 4096-aligned device memory, in CUDA mode only.
fn reg_cuda(cfg: &Config, data: *mut c_void, size: c_int) -> Result<Arc<Ctx>, ncclResult_t> {
    if data as usize % abi::SLICE_PAGE_SIZE != 0 {
        warn!("tcpxemu: regMr: data not aligned ({data:p} is not 4096-aligned)");
        return Err(abi::NCCL_INTERNAL_ERROR);
    }
    if cfg.bounce != Bounce::Cuda {
        warn!(
            "tcpxemu: regMr: CUDA memory ({data:p}, {size} bytes) needs the CUDA mode of the emulation, \
             but this process runs in host mode ({}); use NCCL_PTR_HOST buffers, or run where libcuda \
             and a CUDA device are present (TCPXEMU_BOUNCE=auto or cuda)",
            cfg.bounce_why
        );
        return Err(abi::NCCL_INTERNAL_ERROR);
    }
    let ctx = cuda_ctx(cfg, "regMr")?.ok_or(abi::NCCL_INTERNAL_ERROR)?;
    if size > 0 {
        let kind = cuda::memory_type(&ctx, data as u64);
        if !matches!(
            kind,
            Ok(cuda::MemoryType::Device) | Ok(cuda::MemoryType::Other(4))
        ) {
            warn!(
                "tcpxemu: regMr: {data:p} ({size} bytes) registered as NCCL_PTR_CUDA is not CUDA device \
                 memory ({})",
                match kind {
                    Ok(k) => format!("memory type {k:?}"),
                    Err(e) => e,
                }
            );
            return Err(abi::NCCL_SYSTEM_ERROR);
        }
    }
    Ok(ctx)
}

pub(super) unsafe extern "C" fn dereg_mr(comm: *mut c_void, mhandle: *mut c_void) -> ncclResult_t {
    guard("deregMr", || {
        ok_or((|| {
            // SAFETY: by contract a comm pointer from connect/accept.
            unsafe { comm_ref(comm, "deregMr") }?;
            // SAFETY: by contract a handle from regMr, not yet deregistered.
            unsafe { mr_ref(mhandle, "deregMr") }?;
            // SAFETY: checked above: a live Box<Mr> made by regMr; freed exactly once here.
            let mut m = unsafe { Box::from_raw(mhandle as *mut Mr) };
            m.magic = 0;
            crate::live_mrs(m.size, -1);
            Ok(())
        })())
    })
}

pub(super) unsafe extern "C" fn isend(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    _tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("isend", || {
        ok_or((|| {
            // SAFETY: by contract a comm pointer from connect.
            let cb = unsafe { comm_ref(send_comm, "isend") }?;
            let CommKind::Send(c) = &cb.kind else {
                warn!("tcpxemu: isend on a receive comm");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            };
            if request.is_null() || size < 0 {
                warn!("tcpxemu: isend: NULL request or negative size {size}");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            // SAFETY: non-NULL out-parameter.
            unsafe { *request = ptr::null_mut() };
            // SAFETY: by contract a handle from regMr.
            let m = unsafe { mr_ref(mhandle, "isend") }?;
            if size > 0 && !m.contains(data as usize, size as usize) {
                warn!(
                    "tcpxemu: isend: [{data:p}, +{size}) lies outside the registered range \
                     [{:#x}, +{}) ({})",
                    m.base,
                    m.size,
                    c.label()
                );
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            let slot = c.isend(data as *const u8, size as u32, m.mtype == abi::NCCL_PTR_CUDA)?;
            // SAFETY: non-NULL out-parameter; the slot lives as long as the comm.
            unsafe { *request = (&cb.slots[slot] as *const ReqSlot).cast_mut().cast() };
            Ok(())
        })())
    })
}

pub(super) unsafe extern "C" fn irecv(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    _tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("irecv", || {
        ok_or((|| {
            // SAFETY: by contract a comm pointer from accept.
            let cb = unsafe { comm_ref(recv_comm, "irecv") }?;
            let CommKind::Recv(c) = &cb.kind else {
                warn!("tcpxemu: irecv on a send comm");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            };
            if request.is_null() {
                warn!("tcpxemu: irecv: NULL request");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            // SAFETY: non-NULL out-parameter.
            unsafe { *request = ptr::null_mut() };
            if n != 1 {
                warn!(
                    "tcpxemu: irecv with n={n}: grouped receives are unsupported (maxRecvs is 1; {})",
                    c.label()
                );
                return Err(abi::NCCL_INTERNAL_ERROR);
            }
            if data.is_null() || sizes.is_null() || mhandles.is_null() {
                warn!("tcpxemu: irecv: NULL data, sizes or mhandles array");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            // SAFETY: the caller's arrays hold n == 1 entries each.
            let (dst, size, mh) = unsafe { (*data, *sizes, *mhandles) };
            if size < 0 {
                warn!("tcpxemu: irecv: negative size {size}");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            // SAFETY: by contract a handle from regMr.
            let m = unsafe { mr_ref(mh, "irecv") }?;
            // A CUDA receive's posted destination is never written (its payload lands in the
            // bounce buffer; the consumer's unpack decides where it goes), and the real plugin
            // checks nothing of it against the registration (`tcpxIrecv_v5` records data and
            // size): only its start must lie in the registered range, so one small landing
            // registration can serve receives of any size. Host receives land in place.
            let cuda = m.mtype == abi::NCCL_PTR_CUDA;
            let claimed = if cuda { 1 } else { size as usize };
            if size > 0 && !m.contains(dst as usize, claimed) {
                warn!(
                    "tcpxemu: irecv: [{dst:p}, +{size}) lies outside the registered range \
                     [{:#x}, +{}) ({})",
                    m.base,
                    m.size,
                    c.label()
                );
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            let q = c.irecv(dst.cast(), size as u32, m.mtype == abi::NCCL_PTR_CUDA)?;
            // SAFETY: non-NULL out-parameter; the slot lives as long as the comm.
            unsafe { *request = (&cb.slots[q] as *const ReqSlot).cast_mut().cast() };
            Ok(())
        })())
    })
}

pub(super) unsafe extern "C" fn iflush(
    _recv_comm: *mut c_void,
    _n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut c_int,
    _mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("iflush", || {
        if !request.is_null() {
            // SAFETY: non-NULL out-parameter.
            unsafe { *request = ptr::null_mut() };
        }
        abi::NCCL_SUCCESS
    })
}

/// The slot behind a request pointer, or the "invalid request" error.
///
/// SAFETY: `request` is NULL or a pointer isend/irecv returned on a comm not yet closed.
unsafe fn slot_ref<'a>(request: *mut c_void, what: &str) -> Result<&'a ReqSlot, ncclResult_t> {
    if request.is_null() {
        warn!("tcpxemu: {what} called with invalid request (NULL)");
        return Err(abi::NCCL_INTERNAL_ERROR);
    }
    // SAFETY: non-NULL and, by the caller's contract, a slot inside a live CommBox.
    let s = unsafe { &*(request as *const ReqSlot) };
    if s.magic != REQ_MAGIC || s.comm.is_null() || s.idx >= MAX_REQUESTS {
        warn!("tcpxemu: {what} called with invalid request ({request:p})");
        return Err(abi::NCCL_INTERNAL_ERROR);
    }
    Ok(s)
}

pub(super) unsafe extern "C" fn test(
    request: *mut c_void,
    done: *mut c_int,
    _sizes: *mut c_int,
) -> ncclResult_t {
    guard("test", || {
        ok_or((|| {
            // SAFETY: by contract a request from isend/irecv.
            let s = unsafe { slot_ref(request, "test") }?;
            // SAFETY: a valid slot points at its live comm.
            let cb = unsafe { &*s.comm };
            if done.is_null() {
                warn!("tcpxemu: test: NULL done");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            // `sizes` is never written, as in TCPX.
            let r = match &cb.kind {
                CommKind::Send(c) => c.test(s.idx),
                CommKind::Recv(c) => c.test(s.idx),
            };
            let d = match r {
                Ok(d) => d,
                Err(e) => {
                    // SAFETY: non-NULL out-parameter.
                    unsafe { *done = 0 };
                    return Err(e);
                }
            };
            // SAFETY: non-NULL out-parameter.
            unsafe { *done = c_int::from(d) };
            Ok(())
        })())
    })
}

pub(super) unsafe extern "C" fn get_device_mr(
    _comm: *mut c_void,
    _mhandle: *mut c_void,
    dptr_mhandle: *mut *mut c_void,
) -> ncclResult_t {
    guard("getDeviceMr", || {
        if !dptr_mhandle.is_null() {
            // SAFETY: non-NULL out-parameter.
            unsafe { *dptr_mhandle = ptr::null_mut() };
        }
        abi::NCCL_SUCCESS
    })
}

pub(super) unsafe extern "C" fn irecv_consumed(
    recv_comm: *mut c_void,
    n: c_int,
    request: *mut c_void,
) -> ncclResult_t {
    guard("irecvConsumed", || {
        ok_or((|| {
            // SAFETY: by contract a comm pointer from accept.
            let cb = unsafe { comm_ref(recv_comm, "irecvConsumed") }?;
            let CommKind::Recv(c) = &cb.kind else {
                warn!("tcpxemu: irecvConsumed called with invalid request (a send comm)");
                return Err(abi::NCCL_INTERNAL_ERROR);
            };
            if n != 1 {
                warn!(
                    "tcpxemu: irecvConsumed called with invalid request (n={n}, must be 1; {})",
                    c.label()
                );
                return Err(abi::NCCL_INTERNAL_ERROR);
            }
            // SAFETY: by contract a request from irecv.
            let s = unsafe { slot_ref(request, "irecvConsumed") }?;
            if !ptr::eq(s.comm, cb) {
                warn!(
                    "tcpxemu: irecvConsumed called with invalid request (it belongs to another comm; {})",
                    c.label()
                );
                return Err(abi::NCCL_INTERNAL_ERROR);
            }
            c.consumed(s.idx)
        })())
    })
}
