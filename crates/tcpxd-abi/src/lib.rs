//! `#[repr(C)]` mirrors of the NCCL net-plugin v7 ABI as the GPUDirect-TCPX plugin uses it.
//!
//! The specification is `reference/TCPX_PLUGIN_ABI.md` (§1 and §2). Every size and offset the
//! specification states is checked at compile time at the bottom of this file.
//!
//! This crate is a dependency of the daemon (`tcpxd::net::abi`) and of the emulation plugin
//! (`tcpxemu::abi`), so both sides of the ABI are built from one text.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_ulong, c_void};
use std::mem::{offset_of, size_of};

/// `ncclResult_t`: every plugin function returns one.
pub type ncclResult_t = c_int;

pub const NCCL_SUCCESS: ncclResult_t = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: ncclResult_t = 1;
pub const NCCL_SYSTEM_ERROR: ncclResult_t = 2;
pub const NCCL_INTERNAL_ERROR: ncclResult_t = 3;
pub const NCCL_INVALID_ARGUMENT: ncclResult_t = 4;
pub const NCCL_INVALID_USAGE: ncclResult_t = 5;
pub const NCCL_REMOTE_ERROR: ncclResult_t = 6;
pub const NCCL_IN_PROGRESS: ncclResult_t = 7;

/// Memory types for `regMr` and `ptrSupport`.
pub const NCCL_PTR_HOST: c_int = 0x1;
pub const NCCL_PTR_CUDA: c_int = 0x2;
pub const NCCL_PTR_DMABUF: c_int = 0x4;
/// Alignment of the regions tcpxd allocates: a page, as CUDA `regMr` on TCPX demands (§3: a
/// 4 KiB-aligned pointer, registered as a dma-buf).
pub const REGION_ALIGN: usize = 4096;

/// `netDeviceType` values.
pub const NCCL_NET_DEVICE_HOST: c_int = 0;
pub const NCCL_NET_DEVICE_UNPACK: c_int = 1;
/// NCCL refuses a plugin whose unpack device reports any other version.
pub const NCCL_NET_DEVICE_UNPACK_VERSION: c_int = 0x7;

/// The space NCCL reserves for a listen handle; `listen` writes at most this many bytes.
pub const NCCL_NET_HANDLE_MAXSIZE: usize = 128;

/// Unpack-ring geometry (§2).
pub const NCCL_NET_DEVICE_UNPACK_MAX_QUEUE_DEPTH: usize = 16;
pub const SLICE_PAGE_SIZE: usize = 4096;
pub const NET_UNPACK_MAX_SLICE_SIZE: usize = 4 * 1024 * 1024;
pub const NET_UNPACK_MAX_SLICE_PAGES: usize = NET_UNPACK_MAX_SLICE_SIZE / SLICE_PAGE_SIZE * 2;

/// Outstanding requests a comm can hold (sends until `test` reports done, receives until
/// `irecvConsumed`). Equal to the unpack ring's depth.
pub const MAX_REQUESTS: usize = NCCL_NET_DEVICE_UNPACK_MAX_QUEUE_DEPTH;

/// `ncclDebugLogLevel`.
pub const NCCL_LOG_NONE: c_int = 0;
pub const NCCL_LOG_VERSION: c_int = 1;
pub const NCCL_LOG_WARN: c_int = 2;
pub const NCCL_LOG_INFO: c_int = 3;
pub const NCCL_LOG_ABORT: c_int = 4;
pub const NCCL_LOG_TRACE: c_int = 5;

/// `ncclDebugLogSubSys` bit for the network.
pub const NCCL_NET: c_ulong = 0x10;
pub const NCCL_INIT: c_ulong = 0x1;

/// `void (*)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...)`.
pub type ncclDebugLogger_t = Option<
    unsafe extern "C" fn(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    ),
>;

/// `ncclNetProperties_v7_t` (56 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ncclNetProperties_v7_t {
    pub name: *mut c_char,
    pub pciPath: *mut c_char,
    pub guid: u64,
    pub ptrSupport: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub maxComms: c_int,
    pub maxRecvs: c_int,
    pub netDeviceType: c_int,
    pub netDeviceVersion: c_int,
}

/// `ncclNetDeviceHandle_v7_t` (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ncclNetDeviceHandle_v7_t {
    pub netDeviceType: c_int,
    pub netDeviceVersion: c_int,
    pub handle: *mut c_void,
    pub size: usize,
    pub needsProxyProgress: c_int,
}

/// `union alignas(16) loadMeta`: one fragment of a received request (16 bytes).
#[repr(C, align(16))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct loadMeta {
    /// Offset of the fragment inside the bounce buffer.
    pub src_off: u32,
    /// Fragment length in bytes (≤ 4096 in practice).
    pub len: u32,
    /// Offset of the fragment inside the receive request's destination buffer.
    pub dst_off: u64,
}

/// `struct netUnpackMeta`: the per-recv-comm unpack ring (524416 bytes).
#[repr(C)]
pub struct netUnpackMeta {
    pub mem: [[loadMeta; NET_UNPACK_MAX_SLICE_PAGES]; NCCL_NET_DEVICE_UNPACK_MAX_QUEUE_DEPTH],
    pub cnt: [u64; NCCL_NET_DEVICE_UNPACK_MAX_QUEUE_DEPTH],
}

/// `struct unpackNetDeviceHandle` (24 bytes), the target of the device handle's `handle` field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct unpackNetDeviceHandle {
    pub meta: *mut netUnpackMeta,
    pub bounce_buf: *mut c_void,
    pub head: u64,
}

pub type InitFn = unsafe extern "C" fn(logFn: ncclDebugLogger_t) -> ncclResult_t;
pub type DevicesFn = unsafe extern "C" fn(ndev: *mut c_int) -> ncclResult_t;
pub type GetPropertiesFn =
    unsafe extern "C" fn(dev: c_int, props: *mut ncclNetProperties_v7_t) -> ncclResult_t;
pub type ListenFn =
    unsafe extern "C" fn(dev: c_int, handle: *mut c_void, listenComm: *mut *mut c_void) -> ncclResult_t;
pub type ConnectFn = unsafe extern "C" fn(
    dev: c_int,
    handle: *mut c_void,
    sendComm: *mut *mut c_void,
    sendDevComm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t;
pub type AcceptFn = unsafe extern "C" fn(
    listenComm: *mut c_void,
    recvComm: *mut *mut c_void,
    recvDevComm: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t;
pub type RegMrFn = unsafe extern "C" fn(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    type_: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t;
pub type RegMrDmaBufFn = unsafe extern "C" fn(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    type_: c_int,
    offset: u64,
    fd: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t;
pub type DeregMrFn = unsafe extern "C" fn(comm: *mut c_void, mhandle: *mut c_void) -> ncclResult_t;
pub type IsendFn = unsafe extern "C" fn(
    sendComm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t;
pub type IrecvFn = unsafe extern "C" fn(
    recvComm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t;
pub type IflushFn = unsafe extern "C" fn(
    recvComm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t;
pub type TestFn =
    unsafe extern "C" fn(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> ncclResult_t;
pub type CloseFn = unsafe extern "C" fn(comm: *mut c_void) -> ncclResult_t;
pub type GetDeviceMrFn = unsafe extern "C" fn(
    comm: *mut c_void,
    mhandle: *mut c_void,
    dptr_mhandle: *mut *mut c_void,
) -> ncclResult_t;
pub type IrecvConsumedFn =
    unsafe extern "C" fn(recvComm: *mut c_void, n: c_int, request: *mut c_void) -> ncclResult_t;

/// `ncclNet_v7_t`: the table a plugin exports as `ncclNetPlugin_v7` (19 pointers, 152 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ncclNet_v7_t {
    pub name: *const c_char,
    pub init: Option<InitFn>,
    pub devices: Option<DevicesFn>,
    pub getProperties: Option<GetPropertiesFn>,
    pub listen: Option<ListenFn>,
    pub connect: Option<ConnectFn>,
    pub accept: Option<AcceptFn>,
    pub regMr: Option<RegMrFn>,
    pub regMrDmaBuf: Option<RegMrDmaBufFn>,
    pub deregMr: Option<DeregMrFn>,
    pub isend: Option<IsendFn>,
    pub irecv: Option<IrecvFn>,
    pub iflush: Option<IflushFn>,
    pub test: Option<TestFn>,
    pub closeSend: Option<CloseFn>,
    pub closeRecv: Option<CloseFn>,
    pub closeListen: Option<CloseFn>,
    pub getDeviceMr: Option<GetDeviceMrFn>,
    pub irecvConsumed: Option<IrecvConsumedFn>,
}

// SAFETY: the table is immutable once exported; `name` points at a static C string. Sharing it
// between threads shares only function pointers and that string.
unsafe impl Sync for ncclNet_v7_t {}
// SAFETY: as above; the table holds no thread-bound state.
unsafe impl Send for ncclNet_v7_t {}

/// The symbol every v7 plugin exports.
pub const PLUGIN_SYMBOL_V7: &[u8] = b"ncclNetPlugin_v7\0";

// ---- compile-time layout checks against the specification ----------------------------------

const _: () = assert!(size_of::<ncclNet_v7_t>() == 152);
const _: () = assert!(offset_of!(ncclNet_v7_t, init) == 8);
const _: () = assert!(offset_of!(ncclNet_v7_t, regMrDmaBuf) == 64);
const _: () = assert!(offset_of!(ncclNet_v7_t, isend) == 80);
const _: () = assert!(offset_of!(ncclNet_v7_t, test) == 104);
const _: () = assert!(offset_of!(ncclNet_v7_t, irecvConsumed) == 144);

const _: () = assert!(size_of::<ncclNetProperties_v7_t>() == 56);
const _: () = assert!(offset_of!(ncclNetProperties_v7_t, pciPath) == 8);
const _: () = assert!(offset_of!(ncclNetProperties_v7_t, guid) == 16);
const _: () = assert!(offset_of!(ncclNetProperties_v7_t, ptrSupport) == 24);
const _: () = assert!(offset_of!(ncclNetProperties_v7_t, speed) == 28);
const _: () = assert!(offset_of!(ncclNetProperties_v7_t, port) == 32);
const _: () = assert!(offset_of!(ncclNetProperties_v7_t, latency) == 36);
const _: () = assert!(offset_of!(ncclNetProperties_v7_t, maxComms) == 40);
const _: () = assert!(offset_of!(ncclNetProperties_v7_t, maxRecvs) == 44);
const _: () = assert!(offset_of!(ncclNetProperties_v7_t, netDeviceType) == 48);
const _: () = assert!(offset_of!(ncclNetProperties_v7_t, netDeviceVersion) == 52);

const _: () = assert!(size_of::<ncclNetDeviceHandle_v7_t>() == 32);
const _: () = assert!(offset_of!(ncclNetDeviceHandle_v7_t, netDeviceVersion) == 4);
const _: () = assert!(offset_of!(ncclNetDeviceHandle_v7_t, handle) == 8);
const _: () = assert!(offset_of!(ncclNetDeviceHandle_v7_t, size) == 16);
const _: () = assert!(offset_of!(ncclNetDeviceHandle_v7_t, needsProxyProgress) == 24);

const _: () = assert!(size_of::<loadMeta>() == 16);
const _: () = assert!(std::mem::align_of::<loadMeta>() == 16);
const _: () = assert!(offset_of!(loadMeta, len) == 4);
const _: () = assert!(offset_of!(loadMeta, dst_off) == 8);

const _: () = assert!(NET_UNPACK_MAX_SLICE_PAGES == 2048);
const _: () = assert!(size_of::<netUnpackMeta>() == 524416);
const _: () = assert!(offset_of!(netUnpackMeta, cnt) == 524288);

const _: () = assert!(size_of::<unpackNetDeviceHandle>() == 24);
const _: () = assert!(offset_of!(unpackNetDeviceHandle, bounce_buf) == 8);
const _: () = assert!(offset_of!(unpackNetDeviceHandle, head) == 16);

/// A human name for an `ncclResult_t`.
pub fn result_name(code: ncclResult_t) -> &'static str {
    match code {
        NCCL_SUCCESS => "ncclSuccess",
        NCCL_UNHANDLED_CUDA_ERROR => "ncclUnhandledCudaError",
        NCCL_SYSTEM_ERROR => "ncclSystemError",
        NCCL_INTERNAL_ERROR => "ncclInternalError",
        NCCL_INVALID_ARGUMENT => "ncclInvalidArgument",
        NCCL_INVALID_USAGE => "ncclInvalidUsage",
        NCCL_REMOTE_ERROR => "ncclRemoteError",
        NCCL_IN_PROGRESS => "ncclInProgress",
        _ => "unknown ncclResult_t",
    }
}
