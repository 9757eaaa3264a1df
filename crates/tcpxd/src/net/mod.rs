//! The NCCL net-plugin v7 ABI and a safe layer over it.
//!
//! - [`abi`]: `#[repr(C)]` mirrors with compile-time layout checks.
//! - [`Plugin`]: loading (libloading or an in-process table), `init` with the logger shim,
//!   device properties.
//! - [`ListenComm`], [`Connector`], [`SendComm`], [`RecvComm`], [`MemHandle`]: owners that
//!   enforce the plugin's window and ordering rules before calling it.
//! - [`UnpackRing`]: the fragment lists of completed receives.

/// The v7 ABI mirror (the `tcpxd-abi` crate, shared with the emulation plugin).
pub use tcpxd_abi as abi;
pub mod blocks;
pub mod client_maps;
mod comm;
mod copy_clock;
pub mod copy_routines;
pub mod cross_memory;
mod error;
pub mod host_copies;
pub mod inherited_fds;
pub mod log_limit;
pub mod logger;
mod memory;
mod plugin;
mod ring;
pub mod shared_words;

pub use comm::{
    ConnectHandle, Connector, ListenComm, MemHandle, RecvComm, RecvCompletion, RequestId, SIZE_SENTINEL,
    SendComm, loopback_pair,
};
pub use error::{NetError, NetResult};
pub use memory::{HostRegion, MemType, REGION_ALIGN, Region, RegionWindow};
pub use plugin::{
    DEFAULT_DYNAMIC_CHUNK_SIZE, DeviceProperties, PLUGIN_DEFAULTS, Plugin, PluginSource, RECOMMENDED_ENV,
    missing_plugin_defaults,
};
pub use ring::UnpackRing;
