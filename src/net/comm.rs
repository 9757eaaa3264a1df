//! Safe owners of the plugin's comms, memory handles and requests.
//!
//! The owners enforce the plugin's rules before calling it: at most 16 outstanding requests per
//! comm, `test` only on the oldest in-flight request, `irecvConsumed` only for the oldest completed
//! receive. The `*_unchecked` variants skip exactly that check (and nothing that memory safety
//! depends on) so the conformance suite can watch the plugin enforce its own rules.
//!
//! Every request keeps its memory region alive until the plugin is done with it (a send until
//! `test` reports done, a receive until it is consumed); a comm keeps the plugin loaded.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::abi::{self, loadMeta, ncclNetDeviceHandle_v7_t};
use super::error::{NetError, NetResult};
use super::logger;
use super::memory::Region;
use super::plugin::{Plugin, RawComm};
use super::ring::UnpackRing;

/// A value `test` must leave alone in TCPX (it never writes `*sizes`).
pub const SIZE_SENTINEL: c_int = -0x5A5A_5A5B;

/// How long to sleep between non-blocking connect/accept calls, at first and at most.
const STEP_SLEEP_MIN: Duration = Duration::from_micros(200);
const STEP_SLEEP_MAX: Duration = Duration::from_millis(20);

/// The listen handle a receiver hands to its sender (`NCCL_NET_HANDLE_MAXSIZE` bytes).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ConnectHandle(pub [u8; abi::NCCL_NET_HANDLE_MAXSIZE]);

impl std::fmt::Debug for ConnectHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConnectHandle(")?;
        for b in &self.0[..16] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

impl ConnectHandle {
    pub fn from_bytes(bytes: &[u8]) -> NetResult<ConnectHandle> {
        let arr: [u8; abi::NCCL_NET_HANDLE_MAXSIZE] = bytes.try_into().map_err(|_| {
            NetError::InvalidArgument(format!(
                "a connect handle is {} bytes, got {}",
                abi::NCCL_NET_HANDLE_MAXSIZE,
                bytes.len()
            ))
        })?;
        Ok(ConnectHandle(arr))
    }
}

/// Identifies a request on its comm. Ids grow by one per post; they are never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CommKind {
    Send,
    Recv,
}

/// One plugin comm pointer; closes it when the last owner (comm or memory handle) goes.
struct CommCore {
    plugin: Arc<Plugin>,
    raw: RawComm,
    kind: CommKind,
    dev: i32,
    /// Memory the plugin may still touch (regions of unfinished requests, device-handle storage),
    /// handed over by a dropped owner and freed only after the comm is closed.
    keepalive: std::sync::Mutex<Vec<Box<dyn std::any::Any + Send>>>,
}

impl CommCore {
    fn new(plugin: Arc<Plugin>, raw: RawComm, kind: CommKind, dev: i32) -> Arc<CommCore> {
        Arc::new(CommCore {
            plugin,
            raw,
            kind,
            dev,
            keepalive: std::sync::Mutex::new(Vec::new()),
        })
    }

    fn keep_until_closed(&self, items: impl IntoIterator<Item = Box<dyn std::any::Any + Send>>) {
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
    core: Arc<CommCore>,
    raw: *mut c_void,
    region: Arc<dyn Region>,
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

    fn check_range(&self, offset: usize, len: usize) -> NetResult<*mut u8> {
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

fn register(core: &Arc<CommCore>, region: Arc<dyn Region>) -> NetResult<MemHandle> {
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

/// 16-byte-aligned storage for the device handle `accept` fills.
#[repr(C, align(16))]
struct DeviceHandleStorage(ncclNetDeviceHandle_v7_t);

// SAFETY: plain data the plugin writes once during accept; its pointer field is never dereferenced
// through this storage.
unsafe impl Send for DeviceHandleStorage {}

impl DeviceHandleStorage {
    fn zeroed() -> Box<Self> {
        Box::new(DeviceHandleStorage(ncclNetDeviceHandle_v7_t {
            netDeviceType: 0,
            netDeviceVersion: 0,
            handle: std::ptr::null_mut(),
            size: 0,
            needsProxyProgress: 0,
        }))
    }
}

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
        Ok(Some(SendComm {
            core: CommCore::new(self.plugin.clone(), raw, CommKind::Send, self.dev),
            inflight: VecDeque::with_capacity(abi::MAX_REQUESTS),
            next_id: 0,
            sizes_written: 0,
        }))
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
    let mut sleep = STEP_SLEEP_MIN;
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
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(STEP_SLEEP_MAX);
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

struct SendSlot {
    id: RequestId,
    raw: *mut c_void,
    _region: Arc<dyn Region>,
}

/// A send comm with its in-flight requests, oldest first.
pub struct SendComm {
    core: Arc<CommCore>,
    inflight: VecDeque<SendSlot>,
    next_id: u64,
    sizes_written: u64,
}

// SAFETY: the comm and its request pointers are driven by one thread at a time (`!Sync`).
unsafe impl Send for SendComm {}

impl SendComm {
    pub fn dev(&self) -> i32 {
        self.core.dev
    }

    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.core.plugin
    }

    /// Registers `region` for sending on this comm.
    pub fn register(&self, region: Arc<dyn Region>) -> NetResult<MemHandle> {
        register(&self.core, region)
    }

    /// Requests posted and not yet reported done by `test`.
    pub fn outstanding(&self) -> usize {
        self.inflight.len()
    }

    pub fn can_post(&self) -> bool {
        self.inflight.len() < abi::MAX_REQUESTS
    }

    /// The request `test` may be called on.
    pub fn oldest(&self) -> Option<RequestId> {
        self.inflight.front().map(|s| s.id)
    }

    /// How many times the plugin wrote `*sizes` in `test` (TCPX never does).
    pub fn sizes_written(&self) -> u64 {
        self.sizes_written
    }

    /// Posts a send of `len` bytes at `offset` of `mh`'s region. `Ok(None)`: the plugin could not
    /// take it now (NCCL semantics for a NULL request); post it again later.
    pub fn isend(
        &mut self,
        mh: &MemHandle,
        offset: usize,
        len: usize,
        tag: i32,
    ) -> NetResult<Option<RequestId>> {
        if !self.can_post() {
            return Err(NetError::WindowFull {
                outstanding: self.inflight.len(),
                limit: abi::MAX_REQUESTS,
            });
        }
        self.isend_unchecked(mh, offset, len, tag)
    }

    /// [`SendComm::isend`] without the window check.
    pub fn isend_unchecked(
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
        let data = mh.check_range(offset, len)?;
        let mut req: *mut c_void = std::ptr::null_mut();
        let mark = logger::mark();
        // SAFETY: `data..data+len` lies inside the registered region, which the slot keeps alive
        // until the plugin reports the send done.
        let rc = unsafe {
            self.core.plugin.table.isend.expect("checked")(
                self.core.raw,
                data.cast(),
                len as c_int,
                tag,
                mh.raw,
                &mut req,
            )
        };
        self.core.plugin.check(rc, "isend", mark)?;
        if req.is_null() {
            return Ok(None);
        }
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.inflight.push_back(SendSlot {
            id,
            raw: req,
            _region: mh.region.clone(),
        });
        Ok(Some(id))
    }

    /// Tests the oldest in-flight send. `Ok(true)` frees its slot.
    pub fn test(&mut self, id: RequestId) -> NetResult<bool> {
        if self.oldest() != Some(id) {
            return Err(self.not_oldest(id));
        }
        self.test_unchecked(id)
    }

    fn not_oldest(&self, id: RequestId) -> NetError {
        if self.inflight.iter().any(|s| s.id == id) {
            NetError::OutOfOrder {
                id: id.0,
                expected: "the oldest in-flight send",
            }
        } else {
            NetError::UnknownRequest { id: id.0 }
        }
    }

    /// [`SendComm::test`] on any in-flight request, oldest or not.
    pub fn test_unchecked(&mut self, id: RequestId) -> NetResult<bool> {
        let pos = self
            .inflight
            .iter()
            .position(|s| s.id == id)
            .ok_or(NetError::UnknownRequest { id: id.0 })?;
        let (done, wrote) = test_raw(&self.core, self.inflight[pos].raw)?;
        self.sizes_written += u64::from(wrote);
        if done {
            self.inflight.remove(pos);
        }
        Ok(done)
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        let regions = self
            .inflight
            .drain(..)
            .map(|s| Box::new(s._region) as Box<dyn std::any::Any + Send>);
        self.core.keep_until_closed(regions);
    }
}

/// Calls `test`; returns (done, whether the plugin wrote `*sizes`).
fn test_raw(core: &CommCore, req: *mut c_void) -> NetResult<(bool, bool)> {
    let mut done: c_int = 0;
    let mut size: c_int = SIZE_SENTINEL;
    let mark = logger::mark();
    // SAFETY: `req` is a live request of this comm (its slot is still held).
    let rc = unsafe { core.plugin.table.test.expect("checked")(req, &mut done, &mut size) };
    core.plugin.check(rc, "test", mark)?;
    Ok((done != 0, size != SIZE_SENTINEL))
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
    fn new(
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
        let data = mh.check_range(offset, len)?;
        let mut data_ptr: *mut c_void = data.cast();
        let mut size = len as c_int;
        let mut tag = tag;
        let mut mhandle = mh.raw;
        let mut req: *mut c_void = std::ptr::null_mut();
        let mark = logger::mark();
        // SAFETY: one receive (n = 1) into `len` bytes inside the registered region, which the
        // slot keeps alive until the request is consumed.
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
        if slot.region.mem_type() != super::memory::MemType::Host {
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
        if dst.mem_type() != super::memory::MemType::Host {
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
            // SAFETY: `dst` is an exclusive Rust slice of `len` bytes; the plugin finished writing.
            return unsafe { ring.gather_host(slot.q, dst.as_mut_ptr(), len) };
        }
        self.with_direct(slot, len, |src| {
            dst.copy_from_slice(src);
            Ok(())
        })?;
        Ok(len)
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
        if slot.region.mem_type() != super::memory::MemType::Host {
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
