//! Buffers clients register: their memory, access keys and descriptors, and the byte-level
//! operations (fill, read, checksum) that let a person check a transfer with grpcurl alone.
//!
//! This file holds what a buffer is (`BufferKind`, `BufferMemory`, `BufferEntry`); the rest, each
//! in its own file:
//! - `descriptor.rs`: `Descriptor`, the token another node addresses a buffer by (encode, parse, read);
//! - `registry.rs`: `BufferRegistry`, the daemon's buffers (ids and keys, limits, publish, look-up);
//! - `allocate.rs`: making a buffer's memory (host, host file, CUDA, CUDA IPC import, a client's
//!   pages, a previous instance's host file);
//! - `bytes.rs`: ranges and the byte-level operations (`resolve_range`, `fill`, `read`, `checksum`).

use std::sync::{Arc, Mutex};

use crate::gpu::{DeviceRegion, Gpu, IpcExport};
use crate::net::cross_memory::ClientPages;
use crate::net::{HostRegion, Region};

mod allocate;
mod bytes;
mod descriptor;
mod registry;

pub use bytes::{attach_error, checksum, fill, read, read_into, resolve_range, write_from};
pub use descriptor::{Descriptor, DescriptorFault, MAX_DESCRIPTOR_BYTES};
pub use registry::{BufferRegistry, Ident};

/// Largest range `ReadBuffer` returns.
pub const MAX_READ_BYTES: u64 = 1 << 20;
/// Largest repeated pattern `FillBuffer` takes.
pub const MAX_REPEAT_BYTES: usize = 1 << 20;
/// Longest label.
pub const MAX_LABEL_BYTES: usize = 128;

/// Where a buffer's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferKind {
    Host,
    /// Daemon-allocated CUDA memory (clients map it through its IPC handle).
    Cuda,
    /// A client's CUDA allocation imported from its IPC handle.
    CudaIpc,
    /// A local client's host memory, mapped from the file descriptor it handed over
    /// (src/host_fd.rs).
    HostShared,
    /// A local client's host memory the daemon cannot map, reached by cross-memory attach
    /// (`net::cross_memory`).
    HostAttached,
}

/// A buffer's memory.
pub enum BufferMemory {
    Host(Arc<HostRegion>),
    /// Memory of a client's process, reached by cross-memory attach (`BufferEntry::attached`
    /// holds where): nothing of it is mapped here, not even reserved address space (until
    /// session 21 an unused reservation of its size: an mmap at registration, a munmap at
    /// release).
    Client,
    Cuda {
        region: Arc<DeviceRegion>,
        /// For daemon-allocated memory: the handle clients open.
        export: Option<IpcExport>,
        /// For imported memory: the handle it came from (to refuse importing it twice).
        imported_from: Option<[u8; 64]>,
    },
}

/// A registered buffer.
pub struct BufferEntry {
    pub id: u64,
    pub kind: BufferKind,
    pub size: u64,
    pub label: String,
    /// The access key; replaced by `RekeyBuffer` (old descriptors stop working).
    key: Mutex<[u8; 16]>,
    pub memory: BufferMemory,
    /// For `HostAttached`: the client's pages, which hold the bytes (`memory` is then
    /// `BufferMemory::Client`: across the network such a buffer's chunks are staged through the
    /// lanes' own slots, poller/blocks.rs).
    pub attached: Option<ClientPages>,
}

impl BufferEntry {
    /// The current access key.
    pub fn key(&self) -> [u8; 16] {
        *self.key.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the access key.
    pub fn set_key(&self, key: [u8; 16]) {
        *self.key.lock().unwrap_or_else(|e| e.into_inner()) = key;
    }
}

impl std::fmt::Debug for BufferEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is a secret: never printed.
        f.debug_struct("BufferEntry")
            .field("id", &self.id)
            .field("kind", &self.kind)
            .field("size", &self.size)
            .field("label", &self.label)
            .finish()
    }
}

impl BufferEntry {
    /// The memory as the plugin registers it; None for memory of a client's process (by
    /// address), which is never handed to the plugin (its chunks are staged through the lanes'
    /// slots).
    pub fn region_dyn(&self) -> Option<Arc<dyn Region>> {
        match &self.memory {
            BufferMemory::Host(r) => Some(r.clone()),
            BufferMemory::Cuda { region, .. } => Some(region.clone()),
            BufferMemory::Client => None,
        }
    }

    /// `region_dyn`, or an error naming the buffer (a path that only memory this daemon maps
    /// may take).
    pub fn mapped_region(&self) -> Result<Arc<dyn Region>, String> {
        self.region_dyn().ok_or_else(|| {
            format!(
                "buffer {} is memory of a client's process (registered by address), not mapped here",
                self.id
            )
        })
    }

    /// The host memory, for host buffers.
    pub fn host_region(&self) -> Option<&Arc<HostRegion>> {
        match &self.memory {
            BufferMemory::Host(r) => Some(r),
            BufferMemory::Cuda { .. } | BufferMemory::Client => None,
        }
    }

    /// The GPU holding the buffer, for CUDA buffers.
    pub fn gpu(&self) -> Option<&Arc<Gpu>> {
        match &self.memory {
            BufferMemory::Host(_) | BufferMemory::Client => None,
            BufferMemory::Cuda { region, .. } => Some(region.gpu()),
        }
    }

    /// The device memory, for CUDA buffers.
    pub fn device_region(&self) -> Option<&Arc<DeviceRegion>> {
        match &self.memory {
            BufferMemory::Host(_) | BufferMemory::Client => None,
            BufferMemory::Cuda { region, .. } => Some(region),
        }
    }

    /// The IPC handle clients open, for daemon-allocated CUDA buffers.
    pub fn ipc_export(&self) -> Option<&IpcExport> {
        match &self.memory {
            BufferMemory::Cuda { export, .. } => export.as_ref(),
            BufferMemory::Host(_) | BufferMemory::Client => None,
        }
    }
}

/// The fill patterns and the seeded stream, from the one definition the tools, the emulation and
/// the tests share (`tcpxd-pattern`).
pub use tcpxd_pattern::{Pattern, seeded_bytes};
