//! The 19 entries of `ncclNetPlugin_v7`. Every exported function catches panics and returns
//! `ncclInternalError` instead of unwinding into C.
//!
//! This file is the handles behind the pointers NCCL holds (comms, listen comms, memory handles,
//! request slots, each checked by its magic) and the entries that make and close comms; the
//! memory-registration and request entries are in `requests`.

use crate::abi::{
    self, MAX_REQUESTS, ncclDebugLogger_t, ncclNetDeviceHandle_v7_t, ncclNetProperties_v7_t, ncclResult_t,
};
use crate::config::{self, Bounce, Config, Device};
use crate::connect::{self, Poll};
use crate::cuda::Ctx;
use crate::listen::{AcceptPoll, ListenComm};
use crate::recv::RecvComm;
use crate::send::SendComm;
use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

mod requests;
use requests::{dereg_mr, get_device_mr, iflush, irecv, irecv_consumed, isend, reg_mr, test};

const SEND_MAGIC: u64 = u64::from_le_bytes(*b"TXEMsend");
const RECV_MAGIC: u64 = u64::from_le_bytes(*b"TXEMrecv");
const LISTEN_MAGIC: u64 = u64::from_le_bytes(*b"TXEMlstn");
const MR_MAGIC: u64 = u64::from_le_bytes(*b"TXEMmreg");
const REQ_MAGIC: u64 = u64::from_le_bytes(*b"TXEMreqs");

/// Salt for per-comm random streams.
static COMM_SEQ: AtomicU64 = AtomicU64::new(1);

/// What `*request` points at: one of a comm's 16 slots, pointing back to its comm.
#[repr(C)]
struct ReqSlot {
    magic: u64,
    idx: usize,
    comm: *const CommBox,
}

enum CommKind {
    Send(SendComm),
    Recv(RecvComm),
}

/// What a send or receive comm pointer points at.
#[repr(C)]
struct CommBox {
    magic: u64,
    slots: [ReqSlot; MAX_REQUESTS],
    kind: CommKind,
    /// CUDA mode: the device of the context the comm was made under (its GPU).
    gpu: Option<i32>,
}

#[repr(C)]
struct ListenBox {
    magic: u64,
    comm: ListenComm,
    /// CUDA mode: the context current at `listen` (the comm's GPU), which `accept` works in.
    ctx: Option<Arc<Ctx>>,
    /// Why the listen comm's GPU is not one its NIC serves (its CUDA receives fail), if so.
    misbound: Option<String>,
}

/// A registered memory region.
#[repr(C)]
struct Mr {
    magic: u64,
    mtype: c_int,
    base: usize,
    size: usize,
    /// CUDA memory: the context it was registered under (kept alive while registered).
    ctx: Option<Arc<Ctx>>,
}

impl Mr {
    fn contains(&self, p: usize, len: usize) -> bool {
        p >= self.base && p.checked_add(len).is_some_and(|e| e <= self.base + self.size)
    }
}

fn guard(name: &str, f: impl FnOnce() -> ncclResult_t) -> ncclResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            // Logging itself must not unwind out of here either.
            let _ = catch_unwind(|| warn!("tcpxemu: internal error (panic) in {name}"));
            abi::NCCL_INTERNAL_ERROR
        }
    }
}

fn cfg() -> Result<&'static Config, ncclResult_t> {
    let cfg = config::get().ok_or_else(|| {
        warn!("tcpxemu: plugin used before init");
        abi::NCCL_INTERNAL_ERROR
    })?;
    if let Some(e) = &cfg.init_error {
        warn!("tcpxemu: plugin used after a failed init ({e})");
        return Err(abi::NCCL_SYSTEM_ERROR);
    }
    Ok(cfg)
}

/// CUDA mode: the context to work in (the caller's current one, else the configured device's
/// primary context). `None` in host mode.
fn cuda_ctx(cfg: &Config, what: &str) -> Result<Option<Arc<Ctx>>, ncclResult_t> {
    if cfg.bounce != Bounce::Cuda {
        return Ok(None);
    }
    Ctx::current_or_primary(cfg.cuda_device).map(Some).map_err(|e| {
        warn!("tcpxemu: {what}: no usable CUDA context: {e}");
        abi::NCCL_UNHANDLED_CUDA_ERROR
    })
}

fn device(cfg: &'static Config, dev: c_int, what: &str) -> Result<&'static Device, ncclResult_t> {
    usize::try_from(dev)
        .ok()
        .and_then(|d| cfg.devices.get(d))
        .ok_or_else(|| {
            warn!(
                "tcpxemu: {what}: device {dev} out of range (0..{})",
                cfg.devices.len()
            );
            abi::NCCL_INVALID_ARGUMENT
        })
}

fn new_comm(kind: CommKind, gpu: Option<i32>) -> *mut CommBox {
    let magic = match kind {
        CommKind::Send(_) => SEND_MAGIC,
        CommKind::Recv(_) => RECV_MAGIC,
    };
    let p = Box::into_raw(Box::new(CommBox {
        magic,
        slots: std::array::from_fn(|i| ReqSlot {
            magic: REQ_MAGIC,
            idx: i,
            comm: ptr::null(),
        }),
        kind,
        gpu,
    }));
    // SAFETY: `p` is a fresh, unique allocation; nothing else sees it yet.
    unsafe {
        for s in (*p).slots.iter_mut() {
            s.comm = p;
        }
    }
    p
}

/// The comm behind a caller's pointer, checked for NULL and magic.
///
/// SAFETY: the caller passes a pointer NCCL got from connect/accept and has not closed.
unsafe fn comm_ref<'a>(p: *mut c_void, what: &str) -> Result<&'a CommBox, ncclResult_t> {
    if p.is_null() {
        warn!("tcpxemu: {what}: NULL comm");
        return Err(abi::NCCL_INVALID_ARGUMENT);
    }
    // SAFETY: non-NULL and, by the caller's contract, a live CommBox.
    let c = unsafe { &*(p as *const CommBox) };
    if c.magic != SEND_MAGIC && c.magic != RECV_MAGIC {
        warn!("tcpxemu: {what}: {p:p} is not a tcpxemu comm");
        return Err(abi::NCCL_INVALID_ARGUMENT);
    }
    Ok(c)
}

/// The memory handle behind a caller's pointer.
///
/// SAFETY: the caller passes a pointer regMr returned and deregMr has not freed.
unsafe fn mr_ref<'a>(p: *mut c_void, what: &str) -> Result<&'a Mr, ncclResult_t> {
    if p.is_null() {
        warn!("tcpxemu: {what}: NULL memory handle");
        return Err(abi::NCCL_INVALID_ARGUMENT);
    }
    // SAFETY: non-NULL and, by the caller's contract, a live Mr.
    let m = unsafe { &*(p as *const Mr) };
    if m.magic != MR_MAGIC {
        warn!("tcpxemu: {what}: {p:p} is not a tcpxemu memory handle");
        return Err(abi::NCCL_INVALID_ARGUMENT);
    }
    Ok(m)
}

fn ok_or(r: Result<(), ncclResult_t>) -> ncclResult_t {
    match r {
        Ok(()) => abi::NCCL_SUCCESS,
        Err(e) => e,
    }
}

unsafe extern "C" fn init(log_fn: ncclDebugLogger_t) -> ncclResult_t {
    guard("init", || {
        crate::log::set_logger(log_fn);
        let (cfg, warnings, nccl) = config::init_from_env();
        for w in warnings {
            warn!("{w}");
        }
        for (level, line) in nccl {
            if level == abi::NCCL_LOG_WARN {
                warn!("{line}");
            } else {
                info!("{line}");
            }
        }
        if let Some(e) = &cfg.init_error {
            warn!("{e}");
            return abi::NCCL_SYSTEM_ERROR;
        }
        info!("{}", cfg.summary());
        abi::NCCL_SUCCESS
    })
}

unsafe extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    guard("devices", || {
        ok_or((|| {
            let cfg = cfg()?;
            if ndev.is_null() {
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            // SAFETY: non-NULL out-parameter supplied by the caller.
            unsafe { *ndev = cfg.devices.len() as c_int };
            Ok(())
        })())
    })
}

unsafe extern "C" fn get_properties(dev: c_int, props: *mut ncclNetProperties_v7_t) -> ncclResult_t {
    guard("getProperties", || {
        ok_or((|| {
            let cfg = cfg()?;
            let d = device(cfg, dev, "getProperties")?;
            if props.is_null() {
                warn!("tcpxemu: getProperties: NULL props");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            let speed = if d.rate_gbps > 0.0 {
                ((d.rate_gbps * 1000.0).round() as c_int).max(1)
            } else {
                200_000
            };
            let p = ncclNetProperties_v7_t {
                name: d.ifname.as_ptr().cast_mut(),
                pciPath: d.pci_path.map_or(ptr::null_mut(), |p| p.as_ptr().cast_mut()),
                guid: d.index as u64,
                ptrSupport: abi::NCCL_PTR_HOST | abi::NCCL_PTR_CUDA,
                speed,
                port: 0,
                latency: 0.0,
                maxComms: 65536,
                maxRecvs: 1,
                netDeviceType: abi::NCCL_NET_DEVICE_UNPACK,
                netDeviceVersion: abi::NCCL_NET_DEVICE_UNPACK_VERSION,
            };
            // SAFETY: non-NULL out-parameter of the right type supplied by the caller.
            unsafe { ptr::write_unaligned(props, p) };
            Ok(())
        })())
    })
}

unsafe extern "C" fn listen(dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> ncclResult_t {
    guard("listen", || {
        ok_or((|| {
            let cfg = cfg()?;
            let d = device(cfg, dev, "listen")?;
            if handle.is_null() || listen_comm.is_null() {
                warn!("tcpxemu: listen: NULL handle or listenComm");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            let ctx = cuda_ctx(cfg, "listen")?;
            let misbound = crate::misbound::verdict(cfg, d, ctx.as_deref(), "listen");
            let (comm, desc) = ListenComm::new(d, cfg).map_err(|e| {
                warn!("tcpxemu: listen on {} (dev{dev}) failed: {e}", d.addr);
                abi::NCCL_SYSTEM_ERROR
            })?;
            let mut h = [0u8; abi::NCCL_NET_HANDLE_MAXSIZE];
            desc.encode(&mut h);
            // SAFETY: NCCL provides NCCL_NET_HANDLE_MAXSIZE (128) writable bytes at `handle`.
            unsafe { ptr::copy_nonoverlapping(h.as_ptr(), handle.cast::<u8>(), h.len()) };
            let b = Box::into_raw(Box::new(ListenBox {
                magic: LISTEN_MAGIC,
                comm,
                ctx,
                misbound,
            }));
            // SAFETY: non-NULL out-parameter.
            unsafe { *listen_comm = b.cast() };
            Ok(())
        })())
    })
}

unsafe extern "C" fn connect(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    guard("connect", || {
        ok_or((|| {
            let cfg = cfg()?;
            let d = device(cfg, dev, "connect")?;
            if handle.is_null() || send_comm.is_null() {
                warn!("tcpxemu: connect: NULL handle or sendComm");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            // SAFETY: non-NULL out-parameter.
            unsafe { *send_comm = ptr::null_mut() };
            let mut h = [0u8; abi::NCCL_NET_HANDLE_MAXSIZE];
            // SAFETY: the handle buffer holds 128 bytes (what listen wrote, plus the stage).
            unsafe { ptr::copy_nonoverlapping(handle.cast::<u8>(), h.as_mut_ptr(), h.len()) };
            let polled = connect::step(&mut h, cfg.conn_retry);
            // Write back the stage bytes only (the descriptive part is the caller's).
            let stage = crate::wire::HANDLE_DESC_LEN;
            // SAFETY: as above; bytes 88..128 of the caller's 128-byte buffer.
            unsafe {
                ptr::copy_nonoverlapping(
                    h.as_ptr().add(stage),
                    handle.cast::<u8>().add(stage),
                    h.len() - stage,
                )
            };
            match polled {
                Poll::Pending => Ok(()),
                Poll::Invalid(why) => {
                    warn!("tcpxemu: connect: invalid handle: {why}");
                    Err(abi::NCCL_INVALID_ARGUMENT)
                }
                Poll::Failed(why) => {
                    warn!("{why}");
                    Err(abi::NCCL_SYSTEM_ERROR)
                }
                Poll::Ready(conn) => {
                    let peer = conn.peer;
                    let ctx = cuda_ctx(cfg, "connect")?;
                    let _ = crate::misbound::verdict(cfg, d, ctx.as_deref(), "connect");
                    let c = SendComm::new(conn, d, cfg.chunk_size, ctx.as_ref()).map_err(|e| {
                        warn!("tcpxemu: connect to {peer}: cannot start the send comm: {e}");
                        abi::NCCL_SYSTEM_ERROR
                    })?;
                    let p = new_comm(CommKind::Send(c), ctx.as_ref().map(|c| c.device()));
                    // SAFETY: non-NULL out-parameter.
                    unsafe { *send_comm = p.cast() };
                    Ok(())
                }
            }
        })())
    })
}

unsafe extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    recv_dev_comm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    guard("accept", || {
        ok_or((|| {
            let cfg = cfg()?;
            if listen_comm.is_null() || recv_comm.is_null() {
                warn!("tcpxemu: accept: NULL listenComm or recvComm");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            // SAFETY: non-NULL; by contract a live ListenBox from listen.
            let lb = unsafe { &*(listen_comm as *const ListenBox) };
            if lb.magic != LISTEN_MAGIC {
                warn!("tcpxemu: accept: {listen_comm:p} is not a tcpxemu listen comm");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            // SAFETY: non-NULL out-parameter.
            unsafe { *recv_comm = ptr::null_mut() };
            let group = match lb.comm.accept_step(cfg.flow_wait) {
                AcceptPoll::Pending => return Ok(()),
                AcceptPoll::Ready(g) => g,
            };
            let storage: *mut ncclNetDeviceHandle_v7_t = if recv_dev_comm.is_null() {
                ptr::null_mut()
            } else {
                // SAFETY: non-NULL pointer to the caller's pointer.
                unsafe { *recv_dev_comm }
            };
            let salt = COMM_SEQ.fetch_add(1, Ordering::Relaxed);
            let rc = RecvComm::new(
                group,
                lb.comm.dev,
                cfg,
                !storage.is_null(),
                salt,
                lb.ctx.as_ref(),
                lb.misbound.clone(),
            )
            .map_err(|e| {
                warn!("tcpxemu: accept: cannot set up the receive comm: {e}");
                abi::NCCL_SYSTEM_ERROR
            })?;
            if storage.is_null() {
                info!(
                    "tcpxemu: accept got no device-handle storage (recvDevComm NULL); bounce \
                     receives on this comm will fail ({})",
                    rc.label()
                );
            } else {
                let dh = ncclNetDeviceHandle_v7_t {
                    netDeviceType: abi::NCCL_NET_DEVICE_UNPACK,
                    netDeviceVersion: abi::NCCL_NET_DEVICE_UNPACK_VERSION,
                    handle: rc.unpack_handle().cast(),
                    size: std::mem::size_of::<abi::unpackNetDeviceHandle>(),
                    needsProxyProgress: 1,
                };
                // SAFETY: caller-owned storage for one ncclNetDeviceHandle_v7_t.
                unsafe { ptr::write_unaligned(storage, dh) };
            }
            let p = new_comm(CommKind::Recv(rc), lb.ctx.as_ref().map(|c| c.device()));
            // SAFETY: non-NULL out-parameter.
            unsafe { *recv_comm = p.cast() };
            Ok(())
        })())
    })
}

unsafe extern "C" fn close_send(send_comm: *mut c_void) -> ncclResult_t {
    guard("closeSend", || {
        ok_or((|| {
            // SAFETY: by contract a comm pointer from connect, not yet closed.
            let cb = unsafe { comm_ref(send_comm, "closeSend") }?;
            let CommKind::Send(c) = &cb.kind else {
                warn!("tcpxemu: closeSend on a receive comm");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            };
            c.close();
            info!("tcpxemu: send comm closed ({})", c.label());
            crate::misbound::closed("send", c.label(), cb.gpu);
            // SAFETY: a live Box<CommBox> from new_comm; its helpers are joined; freed once here.
            let mut b = unsafe { Box::from_raw(send_comm as *mut CommBox) };
            b.magic = 0;
            Ok(())
        })())
    })
}

unsafe extern "C" fn close_recv(recv_comm: *mut c_void) -> ncclResult_t {
    guard("closeRecv", || {
        ok_or((|| {
            // SAFETY: by contract a comm pointer from accept, not yet closed.
            let cb = unsafe { comm_ref(recv_comm, "closeRecv") }?;
            let CommKind::Recv(c) = &cb.kind else {
                warn!("tcpxemu: closeRecv on a send comm");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            };
            c.close();
            info!("tcpxemu: recv comm closed ({})", c.label());
            crate::misbound::closed("recv", c.label(), cb.gpu);
            // SAFETY: a live Box<CommBox> from new_comm; its helpers are joined; freed once here.
            let mut b = unsafe { Box::from_raw(recv_comm as *mut CommBox) };
            b.magic = 0;
            Ok(())
        })())
    })
}

unsafe extern "C" fn close_listen(listen_comm: *mut c_void) -> ncclResult_t {
    guard("closeListen", || {
        ok_or((|| {
            if listen_comm.is_null() {
                warn!("tcpxemu: closeListen: NULL listen comm");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            // SAFETY: non-NULL; by contract a live ListenBox from listen.
            let lb = unsafe { &*(listen_comm as *const ListenBox) };
            if lb.magic != LISTEN_MAGIC {
                warn!("tcpxemu: closeListen: {listen_comm:p} is not a tcpxemu listen comm");
                return Err(abi::NCCL_INVALID_ARGUMENT);
            }
            lb.comm.close();
            // SAFETY: a live Box<ListenBox> from listen; its acceptor is joined; freed once here.
            let mut b = unsafe { Box::from_raw(listen_comm as *mut ListenBox) };
            b.magic = 0;
            Ok(())
        })())
    })
}

pub(crate) const TABLE: abi::ncclNet_v7_t = abi::ncclNet_v7_t {
    name: crate::PLUGIN_NAME.as_ptr(),
    init: Some(init),
    devices: Some(devices),
    getProperties: Some(get_properties),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    regMr: Some(reg_mr),
    regMrDmaBuf: None,
    deregMr: Some(dereg_mr),
    isend: Some(isend),
    irecv: Some(irecv),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
    getDeviceMr: Some(get_device_mr),
    irecvConsumed: Some(irecv_consumed),
};
