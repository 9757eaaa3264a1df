//! Opening comms: `listen`/`accept` on the receiving side, `connect` on the sending side, both
//! non-blocking, and `loopback_pair` for a device connected to itself.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ConnectHandle;
use super::comm_core::{CommCore, CommKind, DeviceHandleStorage};
use super::recv::RecvComm;
use super::send::SendComm;
use crate::idle::{Backoff, Pace};
use crate::net::abi::{self, ncclNetDeviceHandle_v7_t};
use crate::net::error::{NetError, NetResult};
use crate::net::logger;
use crate::net::plugin::{Plugin, RawComm};

/// A listening comm on one device; hands out its connect handle and accepts connections.
pub struct ListenComm {
    plugin: Arc<Plugin>,
    raw: RawComm,
    dev: i32,
    handle: ConnectHandle,
    /// Device-handle storage of the accept in progress (the plugin fills it when the comm is ready).
    pending: Option<Box<DeviceHandleStorage>>,
}

// SAFETY: as for comms, one thread at a time drives a listen comm.
unsafe impl Send for ListenComm {}

impl Plugin {
    /// Opens a listening comm on `dev`.
    pub fn listen(self: &Arc<Self>, dev: i32) -> NetResult<ListenComm> {
        self.device(dev)?;
        let mut handle = [0u8; abi::NCCL_NET_HANDLE_MAXSIZE];
        let mut raw: RawComm = std::ptr::null_mut();
        let mark = logger::mark();
        // SAFETY: `handle` has the 128 bytes the plugin may write; `raw` receives the comm.
        let rc = unsafe { self.table.listen.expect("checked")(dev, handle.as_mut_ptr().cast(), &mut raw) };
        self.check(rc, "listen", mark)?;
        if raw.is_null() {
            return Err(NetError::Plugin {
                call: "listen",
                code: abi::NCCL_INTERNAL_ERROR,
                lines: vec!["listen returned success without a listen comm".into()],
            });
        }
        Ok(ListenComm {
            plugin: self.clone(),
            raw,
            dev,
            handle: ConnectHandle(handle),
            pending: None,
        })
    }

    /// Starts connecting to a peer's listen comm on `dev`; drive the [`Connector`] to completion.
    pub fn connector(self: &Arc<Self>, dev: i32, handle: &ConnectHandle) -> NetResult<Connector> {
        self.device(dev)?;
        Ok(Connector {
            plugin: self.clone(),
            dev,
            handle: Some(Box::new(*handle)),
        })
    }

    /// Connects, blocking this thread until the comm is ready or `timeout` passes.
    pub fn connect(
        self: &Arc<Self>,
        dev: i32,
        handle: &ConnectHandle,
        timeout: Duration,
    ) -> NetResult<SendComm> {
        self.connector(dev, handle)?.finish(timeout)
    }
}

impl ListenComm {
    pub fn dev(&self) -> i32 {
        self.dev
    }

    /// The handle to give the peer that will connect.
    pub fn handle(&self) -> ConnectHandle {
        self.handle
    }

    /// One non-blocking `accept` call: `Ok(None)` until the connection is ready.
    pub fn accept_step(&mut self) -> NetResult<Option<RecvComm>> {
        let storage = self.pending.get_or_insert_with(DeviceHandleStorage::zeroed);
        let mut dev_ptr: *mut ncclNetDeviceHandle_v7_t = &mut storage.0;
        let mut raw: RawComm = std::ptr::null_mut();
        let mark = logger::mark();
        // SAFETY: `dev_ptr` points at 16-byte-aligned storage that stays at this address (boxed)
        // across repeated calls until the comm is returned; `raw` receives the comm.
        let rc = unsafe { self.plugin.table.accept.expect("checked")(self.raw, &mut raw, &mut dev_ptr) };
        if let Err(e) = self.plugin.check(rc, "accept", mark) {
            self.pending = None;
            return Err(e);
        }
        if raw.is_null() {
            return Ok(None);
        }
        let storage = self.pending.take().expect("set above");
        // The plugin fills our storage; accept a plugin that instead points us at its own.
        let device_handle = if dev_ptr.is_null() {
            None
        } else {
            // SAFETY: either our own storage or a handle the plugin owns for the comm's lifetime.
            Some(unsafe { *dev_ptr })
        };
        let core = CommCore::new(self.plugin.clone(), raw, CommKind::Recv, self.dev);
        Ok(Some(RecvComm::new(core, storage, device_handle)))
    }

    /// Drives `accept` until the comm is ready or `timeout` passes.
    pub fn accept(&mut self, timeout: Duration) -> NetResult<RecvComm> {
        let mark = logger::mark();
        drive(timeout, || self.accept_step()).map_err(|e| with_lines(e, "accept", mark))
    }
}

impl Drop for ListenComm {
    fn drop(&mut self) {
        let mark = logger::mark();
        // SAFETY: the listen comm is open; nothing uses it after this.
        let rc = unsafe { self.plugin.table.closeListen.expect("checked")(self.raw) };
        if let Err(e) = self.plugin.check(rc, "closeListen", mark) {
            tracing::warn!(dev = self.dev, "{e}");
        }
        if let Some(storage) = self.pending.take() {
            // An accept was in progress: the plugin may still hold the storage pointer.
            Box::leak(storage);
        }
    }
}

/// A non-blocking connect in progress. The plugin keeps its progress inside the handle buffer,
/// so the same buffer is passed on every call.
pub struct Connector {
    plugin: Arc<Plugin>,
    dev: i32,
    handle: Option<Box<ConnectHandle>>,
}

impl Connector {
    /// One non-blocking `connect` call: `Ok(None)` until the comm is ready.
    pub fn step(&mut self) -> NetResult<Option<SendComm>> {
        let handle = self
            .handle
            .as_mut()
            .ok_or_else(|| NetError::InvalidArgument("this connector already finished".into()))?;
        let mut raw: RawComm = std::ptr::null_mut();
        let mut dev_ptr: *mut ncclNetDeviceHandle_v7_t = std::ptr::null_mut();
        let mark = logger::mark();
        // SAFETY: the boxed handle buffer stays at one address across calls (the plugin keeps
        // its connect stage in it); `raw` receives the comm.
        let rc = unsafe {
            self.plugin.table.connect.expect("checked")(
                self.dev,
                handle.0.as_mut_ptr().cast(),
                &mut raw,
                &mut dev_ptr,
            )
        };
        self.plugin.check(rc, "connect", mark)?;
        if raw.is_null() {
            return Ok(None);
        }
        self.handle = None;
        Ok(Some(SendComm::new(CommCore::new(
            self.plugin.clone(),
            raw,
            CommKind::Send,
            self.dev,
        ))))
    }

    /// Drives `connect` until the comm is ready or `timeout` passes.
    pub fn finish(mut self, timeout: Duration) -> NetResult<SendComm> {
        let mark = logger::mark();
        drive(timeout, || self.step()).map_err(|e| with_lines(e, "connect", mark))
    }
}

impl Drop for Connector {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            // Unfinished: the plugin's helper may still reference the handle buffer, so it stays.
            Box::leak(handle);
        }
    }
}

fn drive<T>(timeout: Duration, mut step: impl FnMut() -> NetResult<Option<T>>) -> NetResult<T> {
    let deadline = Instant::now() + timeout;
    let mut backoff = Backoff::with(Pace::CONNECT);
    loop {
        if let Some(v) = step()? {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(NetError::Timeout {
                what: String::new(),
                timeout,
                lines: Vec::new(),
            });
        }
        backoff.step_or_sleep();
    }
}

fn with_lines(e: NetError, what: &str, mark: u64) -> NetError {
    match e {
        NetError::Timeout { timeout, .. } => NetError::Timeout {
            what: what.to_string(),
            timeout,
            lines: logger::lines_since(mark),
        },
        other => other,
    }
}

/// Connects `dev` to itself from one thread, interleaving the non-blocking calls of both sides.
pub fn loopback_pair(plugin: &Arc<Plugin>, dev: i32, timeout: Duration) -> NetResult<(SendComm, RecvComm)> {
    let mut listen = plugin.listen(dev)?;
    let mut connector = plugin.connector(dev, &listen.handle())?;
    let (mut send, mut recv) = (None, None);
    let mark = logger::mark();
    drive(timeout, || {
        if send.is_none() {
            send = connector.step()?;
        }
        if recv.is_none() {
            recv = listen.accept_step()?;
        }
        Ok(if send.is_some() && recv.is_some() {
            Some(())
        } else {
            None
        })
    })
    .map_err(|e| with_lines(e, "connect/accept", mark))?;
    Ok((send.expect("ready"), recv.expect("ready")))
}
