//! The comm pointer all owners of one comm share, memory registration, `test`, and the storage
//! of the device handle `accept` fills.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::SIZE_SENTINEL;
use crate::net::abi::ncclNetDeviceHandle_v7_t;
use crate::net::error::{NetError, NetResult};
use crate::net::logger;
use crate::net::memory::{MemType, Region};
use crate::net::plugin::{Plugin, RawComm};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CommKind {
    Send,
    Recv,
}

/// One plugin comm pointer; closes it when the last owner (comm or memory handle) goes.
pub(super) struct CommCore {
    pub(super) plugin: Arc<Plugin>,
    pub(super) raw: RawComm,
    kind: CommKind,
    pub(super) dev: i32,
    /// Memory the plugin may still touch (regions of unfinished requests, device-handle storage),
    /// handed over by a dropped owner and freed only after the comm is closed.
    keepalive: std::sync::Mutex<Vec<Box<dyn std::any::Any + Send>>>,
}

impl CommCore {
    pub(super) fn new(plugin: Arc<Plugin>, raw: RawComm, kind: CommKind, dev: i32) -> Arc<CommCore> {
        Arc::new(CommCore {
            plugin,
            raw,
            kind,
            dev,
            keepalive: std::sync::Mutex::new(Vec::new()),
        })
    }

    pub(super) fn keep_until_closed(&self, items: impl IntoIterator<Item = Box<dyn std::any::Any + Send>>) {
        self.keepalive
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(items);
    }
}

// SAFETY: a comm pointer is an opaque handle the plugin lets any single thread use at a time; the
// owners below are `Send` but not `Sync`, so only one thread drives a comm.
unsafe impl Send for CommCore {}
// SAFETY: `CommCore` itself exposes nothing but the close in `Drop`, which runs once.
unsafe impl Sync for CommCore {}

impl Drop for CommCore {
    fn drop(&mut self) {
        let (close, call) = match self.kind {
            CommKind::Send => (self.plugin.table.closeSend, "closeSend"),
            CommKind::Recv => (self.plugin.table.closeRecv, "closeRecv"),
        };
        let mark = logger::mark();
        // SAFETY: the comm is open (it came from connect/accept) and no owner can use it again.
        let rc = unsafe { close.expect("checked at load")(self.raw) };
        if let Err(e) = self.plugin.check(rc, call, mark) {
            tracing::warn!(dev = self.dev, "{e}");
        }
    }
}

/// A memory region registered with one comm (`regMr`); deregistered on drop.
pub struct MemHandle {
    pub(super) core: Arc<CommCore>,
    pub(super) raw: *mut c_void,
    pub(super) region: Arc<dyn Region>,
}

// SAFETY: the handle is an opaque plugin pointer; `deregMr` in `Drop` is the only call made on it
// outside its comm's owner, and the plugin's deregistration only frees the handle.
unsafe impl Send for MemHandle {}

impl std::fmt::Debug for MemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemHandle")
            .field("dev", &self.core.dev)
            .field("len", &self.region.len())
            .field("type", &self.region.mem_type())
            .finish()
    }
}

impl MemHandle {
    pub fn region(&self) -> &Arc<dyn Region> {
        &self.region
    }

    pub(super) fn check_range(&self, offset: usize, len: usize) -> NetResult<*mut u8> {
        let end = offset.checked_add(len);
        if end.is_none_or(|e| e > self.region.len()) {
            return Err(NetError::InvalidArgument(format!(
                "range {offset}+{len} is outside the registered {}-byte region",
                self.region.len()
            )));
        }
        if len > i32::MAX as usize {
            return Err(NetError::InvalidArgument(format!(
                "request of {len} bytes exceeds the plugin's int size limit (2147483647)"
            )));
        }
        // SAFETY: `offset` is within the region (checked above).
        Ok(unsafe { self.region.as_ptr().add(offset) })
    }
    /// A receive's posted range: as [`MemHandle::check_range`] for host memory; for CUDA memory
    /// only its start must lie inside the region, since the plugin never writes a CUDA receive's
    /// posted destination — its payload lands in the GPU's bounce pages and the unpack decides
    /// where it goes (docs/ARCHITECTURE.md, "What a CUDA receive may name"). So one small
    /// landing registration serves credit receives of any size.
    pub(super) fn check_receive(&self, offset: usize, len: usize) -> NetResult<*mut u8> {
        if self.region.mem_type() == MemType::Host || len == 0 {
            return self.check_range(offset, len);
        }
        if offset >= self.region.len() {
            return Err(NetError::InvalidArgument(format!(
                "a CUDA receive at offset {offset} starts outside the registered {}-byte region",
                self.region.len()
            )));
        }
        if len > i32::MAX as usize {
            return Err(NetError::InvalidArgument(format!(
                "request of {len} bytes exceeds the plugin's int size limit (2147483647)"
            )));
        }
        // SAFETY: `offset` is within the region (checked above).
        Ok(unsafe { self.region.as_ptr().add(offset) })
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        let mark = logger::mark();
        // SAFETY: `raw` came from regMr on this comm, which `core` keeps open.
        let rc = unsafe { self.core.plugin.table.deregMr.expect("checked")(self.core.raw, self.raw) };
        if let Err(e) = self.core.plugin.check(rc, "deregMr", mark) {
            tracing::warn!(dev = self.core.dev, "{e}");
        }
    }
}

pub(super) fn register(core: &Arc<CommCore>, region: Arc<dyn Region>) -> NetResult<MemHandle> {
    let size = c_int::try_from(region.len()).map_err(|_| {
        NetError::InvalidArgument(format!(
            "regMr takes an int size: a region of {} bytes is larger than 2147483647",
            region.len()
        ))
    })?;
    let mut raw: *mut c_void = std::ptr::null_mut();
    let mark = logger::mark();
    // SAFETY: `region` is live memory of `size` bytes, kept alive by the returned handle.
    let rc = unsafe {
        core.plugin.table.regMr.expect("checked")(
            core.raw,
            region.as_ptr().cast(),
            size,
            region.mem_type().nccl_ptr_type(),
            &mut raw,
        )
    };
    core.plugin.check(rc, "regMr", mark)?;
    Ok(MemHandle {
        core: core.clone(),
        raw,
        region,
    })
}

/// Calls `test`; returns (done, whether the plugin wrote `*sizes`).
pub(super) fn test_raw(core: &CommCore, req: *mut c_void) -> NetResult<(bool, bool)> {
    let mut done: c_int = 0;
    let mut size: c_int = SIZE_SENTINEL;
    let mark = logger::mark();
    // SAFETY: `req` is a live request of this comm (its slot is still held).
    let rc = unsafe { core.plugin.table.test.expect("checked")(req, &mut done, &mut size) };
    core.plugin.check(rc, "test", mark)?;
    Ok((done != 0, size != SIZE_SENTINEL))
}

/// 16-byte-aligned storage for the device handle `accept` fills.
#[repr(C, align(16))]
pub(super) struct DeviceHandleStorage(pub(super) ncclNetDeviceHandle_v7_t);

// SAFETY: plain data the plugin writes once during accept; its pointer field is never dereferenced
// through this storage.
unsafe impl Send for DeviceHandleStorage {}

impl DeviceHandleStorage {
    pub(super) fn zeroed() -> Box<Self> {
        Box::new(DeviceHandleStorage(ncclNetDeviceHandle_v7_t {
            netDeviceType: 0,
            netDeviceVersion: 0,
            handle: std::ptr::null_mut(),
            size: 0,
            needsProxyProgress: 0,
        }))
    }
}
