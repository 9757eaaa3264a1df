//! Buffers clients register: their memory, access keys and descriptors, and the byte-level
//! operations (fill, read, checksum) that let a person check a transfer with grpcurl alone.

use std::collections::HashMap;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::engine::{Code, EngineError};
use crate::gpu::{DeviceRegion, Gpu, IpcExport, Stream};
use crate::headroom::{DEFAULT_RESERVE, Headroom};
use crate::net::cross_memory::ClientPages;
use crate::net::{HostRegion, REGION_ALIGN, Region};

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

/// What another node needs to address a buffer and reach its daemon:
/// `tcpxd1:<node>:<buffer id>:<size>:<key hex>[@<peer address>[,<peer address>…]]`. The
/// addresses (the daemon's `peer.advertise`) let a daemon that never met this node pair with it on
/// first use; a descriptor without them (from an older daemon) still parses.
#[derive(Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub node_id: String,
    pub buffer_id: u64,
    pub size: u64,
    pub key: [u8; 16],
    /// Where the node's peer service can be dialled (host:port each); may be empty.
    pub addresses: Vec<String>,
}

impl std::fmt::Debug for Descriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Descriptor({}:{}, {} bytes, at {:?})",
            self.node_id, self.buffer_id, self.size, self.addresses
        )
    }
}

const DESCRIPTOR_PREFIX: &str = "tcpxd1";
/// The longest descriptor accepted (5 fixed fields and 8 longest addresses fit).
pub const MAX_DESCRIPTOR_BYTES: usize = 2560;

impl Descriptor {
    pub fn encode(&self) -> String {
        let mut s = format!(
            "{DESCRIPTOR_PREFIX}:{}:{}:{}:{}",
            self.node_id,
            self.buffer_id,
            self.size,
            hex::encode(self.key)
        );
        if !self.addresses.is_empty() {
            s.push('@');
            s.push_str(&self.addresses.join(","));
        }
        s
    }

    /// Parses a descriptor; the error names what is malformed (never echoing the key).
    pub fn parse(field: &str, s: &str) -> Result<Descriptor, EngineError> {
        let bad = |why: &str| EngineError::invalid(format!("{field}: malformed descriptor: {why}"));
        if s.len() > MAX_DESCRIPTOR_BYTES {
            return Err(EngineError::invalid(format!(
                "{field}: {} bytes, over the limit of {MAX_DESCRIPTOR_BYTES} for a descriptor",
                s.len()
            )));
        }
        let (head, addresses) = match s.split_once('@') {
            Some((head, tail)) => (head, Some(tail)),
            None => (s, None),
        };
        let parts: Vec<&str> = head.split(':').collect();
        if parts.len() != 5 || parts[0] != DESCRIPTOR_PREFIX {
            return Err(bad(
                "expected tcpxd1:<node>:<buffer id>:<size>:<32 hex digits>[@<host:port>,…]",
            ));
        }
        if crate::config::check_node_id(parts[1]).is_err() {
            return Err(bad("invalid node id"));
        }
        let buffer_id = parts[2].parse().map_err(|_| bad("buffer id is not a number"))?;
        let size = parts[3].parse().map_err(|_| bad("size is not a number"))?;
        let raw = hex::decode(parts[4]).map_err(|_| bad("access key is not hex"))?;
        let key: [u8; 16] = raw.try_into().map_err(|_| bad("access key is not 16 bytes"))?;
        let addresses: Vec<String> = match addresses {
            None => Vec::new(),
            Some(tail) => tail.split(',').map(str::to_string).collect(),
        };
        crate::advertise::check_peer_addresses("peer address", &addresses).map_err(|why| bad(&why))?;
        Ok(Descriptor {
            node_id: parts[1].to_string(),
            buffer_id,
            size,
            key,
            addresses,
        })
    }
}

/// The buffers of this daemon. The poller keeps its own copy of each entry it uses.
pub struct BufferRegistry {
    node_id: String,
    /// The peer addresses every descriptor carries (`peer.advertise`).
    advertise: Vec<String>,
    max_buffer_bytes: u64,
    /// What a host registration may fault in (`transfer.host_memory_reserve_bytes`).
    pub(crate) headroom: Headroom,
    next_id: AtomicU64,
    map: Mutex<HashMap<u64, Arc<BufferEntry>>>,
    /// Where daemon-allocated host memory lives as files (the state directory's `host/`, on
    /// tmpfs): its bytes outlive the process. `None`: anonymous memory.
    host_dir: Option<std::path::PathBuf>,
    /// Where daemon-allocated CUDA memory keeps its fd across a restart (src/cuda_kept.rs), and
    /// the buffers whose fd is there.
    pub(crate) cuda_store: Option<crate::fd_store::CudaStore>,
}

/// The id and key a registration takes back after a restart (re-attach).
#[derive(Debug, Clone, Copy)]
pub struct Ident {
    pub id: u64,
    pub key: [u8; 16],
}

impl BufferRegistry {
    pub fn new(node_id: &str, max_buffer_bytes: u64) -> BufferRegistry {
        BufferRegistry {
            node_id: node_id.to_string(),
            advertise: Vec::new(),
            max_buffer_bytes,
            headroom: Headroom::system(DEFAULT_RESERVE),
            next_id: AtomicU64::new(1),
            map: Mutex::new(HashMap::new()),
            host_dir: None,
            cuda_store: None,
        }
    }

    /// A new buffer id.
    pub(crate) fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Daemon-allocated host memory lives in files named by buffer id in `dir` (a tmpfs).
    pub fn with_host_dir(mut self, dir: std::path::PathBuf) -> BufferRegistry {
        self.host_dir = Some(dir);
        self
    }

    /// New ids start at `first` at the lowest (above every id an earlier instance handed out).
    pub fn start_ids_at(&self, first: u64) {
        self.next_id.fetch_max(first, Ordering::Relaxed);
    }

    /// Host registrations fault memory in only within `headroom` (the node's memory, keeping a
    /// reserve free: [`crate::headroom`]).
    pub fn with_headroom(mut self, headroom: Headroom) -> BufferRegistry {
        self.headroom = headroom;
        self
    }

    /// The host memory check's reading now (metrics): [`Headroom::reading`].
    pub fn memory_reading(&self) -> (Option<u64>, u64) {
        self.headroom.reading()
    }

    /// Descriptors carry these peer addresses (checked by the caller).
    pub fn with_advertise(mut self, addresses: Vec<String>) -> BufferRegistry {
        self.advertise = addresses;
        self
    }

    pub(crate) fn check_new(&self, field: &str, size: u64, label: &str) -> Result<(), EngineError> {
        if size == 0 || size > self.max_buffer_bytes {
            return Err(EngineError::invalid(format!(
                "{field}: {size} bytes is outside 1..={} (max_buffer_bytes)",
                self.max_buffer_bytes
            )));
        }
        if label.len() > MAX_LABEL_BYTES {
            return Err(EngineError::invalid(format!(
                "label: {} bytes exceed the limit of {MAX_LABEL_BYTES}",
                label.len()
            )));
        }
        Ok(())
    }

    pub(crate) fn entry(
        &self,
        kind: BufferKind,
        size: u64,
        label: &str,
        memory: BufferMemory,
    ) -> Arc<BufferEntry> {
        self.entry_as(kind, size, label, memory, None)
    }

    /// As [`BufferRegistry::entry`], with the id and key of a re-attached registration.
    pub(crate) fn entry_as(
        &self,
        kind: BufferKind,
        size: u64,
        label: &str,
        memory: BufferMemory,
        ident: Option<Ident>,
    ) -> Arc<BufferEntry> {
        let (id, key) = match ident {
            Some(i) => (i.id, i.key),
            None => (self.next_id.fetch_add(1, Ordering::Relaxed), rand::random()),
        };
        Arc::new(BufferEntry {
            id,
            kind,
            size,
            label: label.to_string(),
            key: Mutex::new(key),
            memory,
            attached: None,
        })
    }

    /// A local client's memory by address (`net::cross_memory`), its access checked by the
    /// caller: a buffer whose bytes stay in the client's pages. Its `memory` is address space
    /// reserved lazily (no RAM until touched; nothing touches it: transfers read and write the
    /// client's pages, between nodes through the lanes' slots).
    pub fn client_pages(
        &self,
        pages: ClientPages,
        size: u64,
        label: &str,
        ident: Option<Ident>,
    ) -> Result<Arc<BufferEntry>, EngineError> {
        self.check_new("size", size, label)?;
        usize::try_from(size).map_err(|_| EngineError::invalid("size: too large for this machine"))?;
        let (id, key) = match ident {
            Some(i) => (i.id, i.key),
            None => (self.next_id.fetch_add(1, Ordering::Relaxed), rand::random()),
        };
        Ok(Arc::new(BufferEntry {
            id,
            kind: BufferKind::HostAttached,
            size,
            label: label.to_string(),
            key: Mutex::new(key),
            memory: BufferMemory::Client,
            attached: Some(pages),
        }))
    }

    /// The GPU `device` (opened once), or why there is none.
    pub fn gpu(&self, field: &str, device: u32) -> Result<Arc<Gpu>, EngineError> {
        let unavailable = |why: String| EngineError::new(Code::FailedPrecondition, format!("{field}: {why}"));
        if !crate::gpu::driver_available() {
            return Err(unavailable(
                "no CUDA driver on this machine (libcuda.so.1 not found): CUDA buffers need a GPU".into(),
            ));
        }
        let count = Gpu::device_count().map_err(|e| unavailable(e.to_string()))?;
        if device as usize >= count {
            return Err(EngineError::invalid(format!(
                "{field}: device {device} does not exist (this machine has {count} GPUs)"
            )));
        }
        crate::gpu::shared(device as usize).map_err(|e| unavailable(e.to_string()))
    }

    /// Allocates CUDA memory on `device` and exports its IPC handle.
    pub fn allocate_cuda(
        &self,
        device: u32,
        size: u64,
        label: &str,
    ) -> Result<Arc<BufferEntry>, EngineError> {
        self.check_new("cuda.size", size, label)?;
        let gpu = self.gpu("cuda.device", device)?;
        let region = gpu.alloc(size as usize).map_err(|e| {
            EngineError::new(
                Code::ResourceExhausted,
                format!("cuda.size: cannot allocate {size} bytes: {e}"),
            )
        })?;
        let export = region
            .export_ipc()
            .map_err(|e| EngineError::new(Code::Internal, format!("exporting the IPC handle: {e}")))?;
        Ok(self.entry(
            BufferKind::Cuda,
            size,
            label,
            BufferMemory::Cuda {
                region: Arc::new(region),
                export: Some(export),
                imported_from: None,
            },
        ))
    }

    /// Imports a client's CUDA allocation from its IPC handle.
    pub fn import_cuda(
        &self,
        device: u32,
        handle: &[u8],
        offset: u64,
        size: u64,
        label: &str,
    ) -> Result<Arc<BufferEntry>, EngineError> {
        self.import_cuda_as(device, handle, offset, size, label, None)
    }

    /// As [`BufferRegistry::import_cuda`], taking back a re-attached id and key.
    pub fn import_cuda_as(
        &self,
        device: u32,
        handle: &[u8],
        offset: u64,
        size: u64,
        label: &str,
        ident: Option<Ident>,
    ) -> Result<Arc<BufferEntry>, EngineError> {
        self.check_new("cuda_ipc.size", size, label)?;
        let handle: [u8; 64] = handle.try_into().map_err(|_| {
            EngineError::invalid(format!(
                "cuda_ipc.ipc_handle: {} bytes, expected 64",
                handle.len()
            ))
        })?;
        let gpu = self.gpu("cuda_ipc.device", device)?;
        // A process opens an IPC handle once: an allocation imported already (by another client
        // of the same process, say two NIXL agents) is shared with that buffer, its mapping closed
        // with the last buffer using it.
        let imported = self.list().into_iter().find_map(|b| match &b.memory {
            BufferMemory::Cuda {
                region,
                imported_from,
                ..
            } if imported_from.as_ref() == Some(&handle) => Some((b.id, region.clone())),
            _ => None,
        });
        let region = match imported {
            Some((other, region)) => {
                if region.gpu().ordinal() != gpu.ordinal() {
                    return Err(EngineError::invalid(format!(
                        "cuda_ipc.device: {device}, but this allocation is on GPU {} (imported as buffer {other})",
                        region.gpu().ordinal()
                    )));
                }
                DeviceRegion::view_of(&region, offset, size as usize).map_err(|e| {
                    EngineError::invalid(format!("cuda_ipc: cannot share buffer {other}'s import: {e}"))
                })?
            }
            None => gpu
                .import_ipc(&handle, offset, size as usize)
                .map_err(|e| EngineError::invalid(format!("cuda_ipc: cannot import the handle: {e}")))?,
        };
        if region.device_ptr() % REGION_ALIGN as u64 != 0 {
            return Err(EngineError::invalid(format!(
                "cuda_ipc.offset: the buffer starts at {:#x}, which is not 4 KiB-aligned; TCPX registers \
                 only 4 KiB-aligned GPU memory (allocate the tensor on its own, or at an aligned offset)",
                region.device_ptr()
            )));
        }
        Ok(self.entry_as(
            BufferKind::CudaIpc,
            size,
            label,
            BufferMemory::Cuda {
                region: Arc::new(region),
                export: None,
                imported_from: Some(handle),
            },
            ident,
        ))
    }

    /// Allocates a host buffer (not yet visible: [`BufferRegistry::publish`] makes it so once
    /// the poller knows it).
    pub fn allocate_host(&self, size: u64, label: &str) -> Result<Arc<BufferEntry>, EngineError> {
        self.check_new("host.size", size, label)?;
        let len = usize::try_from(size)
            .map_err(|_| EngineError::invalid("host.size: too large for this machine"))?;
        // Within what the node has (else the OOM killer, not an error, would answer), and
        // populated now: no transfer into or out of it page-faults later.
        if let Some(dir) = &self.host_dir {
            return self.allocate_host_file(dir, size, label);
        }
        let _admitted = self
            .headroom
            .admit("host.size", size.next_multiple_of(REGION_ALIGN as u64))?;
        let region = HostRegion::populated(len).map_err(|e| {
            EngineError::new(
                Code::ResourceExhausted,
                format!("host.size: cannot allocate {size} bytes: {e}"),
            )
        })?;
        Ok(self.entry(
            BufferKind::Host,
            size,
            label,
            BufferMemory::Host(Arc::new(region)),
        ))
    }

    /// A daemon-allocated host buffer in a new file of `dir`, named by its id, faulted in.
    fn allocate_host_file(
        &self,
        dir: &std::path::Path,
        size: u64,
        label: &str,
    ) -> Result<Arc<BufferEntry>, EngineError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(id.to_string());
        let made = (|| {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)?;
            f.set_len(size)?;
            Ok::<_, std::io::Error>(std::os::fd::OwnedFd::from(f))
        })()
        .map_err(|e| {
            EngineError::new(
                Code::ResourceExhausted,
                format!("host.size: cannot create {}: {e}", path.display()),
            )
        })?;
        let mapped = crate::host_file::map_client_file(
            &made,
            0,
            size,
            crate::host_file::Unsealed::Allowed,
            &self.headroom,
        )
        .map_err(|mut e| {
            e.message = e.message.replacen("register_host_fd.", "host.", 1);
            e
        });
        let (region, _) = match mapped {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        let ident = Ident {
            id,
            key: rand::random(),
        };
        Ok(self.entry_as(
            BufferKind::Host,
            size,
            label,
            BufferMemory::Host(Arc::new(region)),
            Some(ident),
        ))
    }

    /// A daemon-allocated host buffer of the previous instance, from its file (bytes and all),
    /// with its id and key.
    pub fn restore_host(&self, kept: &crate::journal::KeptHost) -> Result<Arc<BufferEntry>, EngineError> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&kept.file)
            .map_err(|e| EngineError::new(Code::Internal, format!("{}: {e}", kept.file.display())))?;
        let fd = std::os::fd::OwnedFd::from(f);
        let (region, _) = crate::host_file::map_client_file(
            &fd,
            0,
            kept.size,
            crate::host_file::Unsealed::Allowed,
            &self.headroom,
        )?;
        let ident = Ident {
            id: kept.id,
            key: kept.key,
        };
        Ok(self.entry_as(
            BufferKind::Host,
            kept.size,
            &kept.label,
            BufferMemory::Host(Arc::new(region)),
            Some(ident),
        ))
    }

    /// Makes a buffer visible. A non-empty label names one buffer only: a second registration
    /// under the same label is refused with ALREADY_EXISTS.
    pub fn publish(&self, entry: Arc<BufferEntry>) -> Result<(), EngineError> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if !entry.label.is_empty()
            && let Some(other) = map.values().find(|b| b.label == entry.label)
        {
            return Err(EngineError::new(
                Code::AlreadyExists,
                format!(
                    "label: buffer {} is already registered as {:?}",
                    other.id, entry.label
                ),
            ));
        }
        map.insert(entry.id, entry);
        Ok(())
    }

    pub fn remove(&self, id: u64) -> Option<Arc<BufferEntry>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).remove(&id)
    }

    pub fn get(&self, id: u64) -> Result<Arc<BufferEntry>, EngineError> {
        self.get_as("buffer_id", id)
    }

    /// Like [`Buffers::get`], naming the request's field in the error (`entries[0].local_buffer_id`).
    pub fn get_as(&self, field: &str, id: u64) -> Result<Arc<BufferEntry>, EngineError> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| EngineError::not_found(format!("{field}: buffer {id} does not exist")))
    }

    pub fn list(&self) -> Vec<Arc<BufferEntry>> {
        let mut v: Vec<_> = self
            .map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        v.sort_by_key(|b| b.id);
        v
    }

    pub fn descriptor(&self, b: &BufferEntry) -> Descriptor {
        Descriptor {
            node_id: self.node_id.clone(),
            buffer_id: b.id,
            size: b.size,
            key: b.key(),
            addresses: self.advertise.clone(),
        }
    }
}

/// Resolves `(offset, length)` against a buffer; `length == 0` with `zero_means_rest` means
/// "to the end".
pub fn resolve_range(
    b: &BufferEntry,
    offset: u64,
    length: u64,
    zero_means_rest: bool,
) -> Result<(u64, u64), EngineError> {
    let length = if length == 0 && zero_means_rest {
        b.size.checked_sub(offset).ok_or_else(|| {
            EngineError::invalid(format!(
                "offset: {offset} is past the end of buffer {} ({} bytes)",
                b.id, b.size
            ))
        })?
    } else {
        length
    };
    match offset.checked_add(length) {
        None => Err(EngineError::invalid(format!(
            "offset + length: {offset} + {length} overflows 64 bits"
        ))),
        Some(end) if end > b.size => Err(EngineError::invalid(format!(
            "offset + length: range {offset}..{end} is past the end of buffer {} ({} bytes)",
            b.id, b.size
        ))),
        Some(_) => Ok((offset, length)),
    }
}

/// The fill patterns and the seeded stream, from the one definition the tools, the emulation and
/// the tests share (`tcpxd-pattern`).
pub use tcpxd_pattern::{Pattern, seeded_bytes};

const SCRATCH: usize = 1 << 20;

/// A client's pages the kernel would not copy: the permission is missing (FAILED_PRECONDITION,
/// naming the setting), the client is gone or its memory is (NOT_FOUND / INVALID_ARGUMENT).
pub fn attach_error(e: crate::net::cross_memory::AttachError) -> EngineError {
    use crate::net::cross_memory::AttachError as A;
    let code = match &e {
        A::Denied { .. } => Code::FailedPrecondition,
        A::Gone { .. } => Code::NotFound,
        A::Fault { .. } | A::ReadOnly { .. } => Code::InvalidArgument,
        A::Other(..) => Code::Internal,
    };
    EngineError::new(code, e.to_string())
}

fn gpu_error(e: crate::gpu::GpuError) -> EngineError {
    EngineError::new(Code::Internal, format!("GPU: {e}"))
}

/// Fills `[offset, offset + length)` of the buffer.
pub fn fill(b: &BufferEntry, offset: u64, length: u64, pattern: &Pattern) -> Result<(), EngineError> {
    if let Some(pages) = &b.attached {
        let mut scratch = vec![0u8; SCRATCH.min(length as usize)];
        let mut pos = offset;
        while pos < offset + length {
            let n = ((offset + length - pos) as usize).min(SCRATCH);
            pattern.write(offset, pos, &mut scratch[..n]);
            pages.write(pos, &scratch[..n]).map_err(attach_error)?;
            pos += n as u64;
        }
        return Ok(());
    }
    match &b.memory {
        BufferMemory::Client => Err(EngineError::new(
            Code::Internal,
            format!("buffer {}: client memory without its pages", b.id),
        )),
        BufferMemory::Host(region) => {
            let mut scratch = vec![0u8; SCRATCH.min(length as usize)];
            let mut pos = offset;
            let end = offset + length;
            while pos < end {
                let n = ((end - pos) as usize).min(SCRATCH);
                pattern.write(offset, pos, &mut scratch[..n]);
                region
                    .write(pos as usize, &scratch[..n])
                    .map_err(|e| EngineError::new(Code::Internal, e.to_string()))?;
                pos += n as u64;
            }
            Ok(())
        }
        BufferMemory::Cuda { region, .. } => {
            let stream = Stream::new(region.gpu()).map_err(gpu_error)?;
            region
                .fill_with(&stream, offset, length, |pos, out| {
                    pattern.write(offset, pos, out)
                })
                .map_err(gpu_error)
        }
    }
}

/// Copies `len` bytes at `offset` out of the buffer.
pub fn read(b: &BufferEntry, offset: u64, len: u64) -> Result<Vec<u8>, EngineError> {
    if let Some(pages) = &b.attached {
        let mut out = vec![0u8; len as usize];
        pages.read(offset, &mut out).map_err(attach_error)?;
        return Ok(out);
    }
    match &b.memory {
        BufferMemory::Client => Err(EngineError::new(
            Code::Internal,
            format!("buffer {}: client memory without its pages", b.id),
        )),
        BufferMemory::Host(region) => region
            .to_vec(offset as usize, len as usize)
            .map_err(|e| EngineError::new(Code::Internal, e.to_string())),
        BufferMemory::Cuda { region, .. } => {
            let mut out = vec![0u8; len as usize];
            region.read(offset, &mut out).map_err(gpu_error)?;
            Ok(out)
        }
    }
}

/// CRC-32C of `[offset, offset + length)`.
pub fn checksum(b: &BufferEntry, offset: u64, length: u64) -> Result<u32, EngineError> {
    if let Some(pages) = &b.attached {
        let mut scratch = vec![0u8; SCRATCH.min(length as usize)];
        let (mut crc, mut pos) = (0u32, offset);
        while pos < offset + length {
            let n = ((offset + length - pos) as usize).min(SCRATCH);
            pages.read(pos, &mut scratch[..n]).map_err(attach_error)?;
            crc = crc32c::crc32c_append(crc, &scratch[..n]);
            pos += n as u64;
        }
        return Ok(crc);
    }
    match &b.memory {
        BufferMemory::Client => Err(EngineError::new(
            Code::Internal,
            format!("buffer {}: client memory without its pages", b.id),
        )),
        BufferMemory::Host(region) => {
            let mut scratch = vec![0u8; SCRATCH.min(length as usize)];
            let mut crc = 0u32;
            let mut pos = offset;
            let end = offset + length;
            while pos < end {
                let n = ((end - pos) as usize).min(SCRATCH);
                region
                    .read(pos as usize, &mut scratch[..n])
                    .map_err(|e| EngineError::new(Code::Internal, e.to_string()))?;
                crc = crc32c::crc32c_append(crc, &scratch[..n]);
                pos += n as u64;
            }
            Ok(crc)
        }
        BufferMemory::Cuda { region, .. } => {
            let stream = Stream::new(region.gpu()).map_err(gpu_error)?;
            region.crc32c(&stream, offset, length).map_err(gpu_error)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_malformed_ones_are_named() {
        let d = Descriptor {
            node_id: "node-a.1".into(),
            buffer_id: 42,
            size: 1 << 30,
            key: [0xAB; 16],
            addresses: Vec::new(),
        };
        let s = d.encode();
        assert_eq!(Descriptor::parse("remote_descriptor", &s).unwrap(), d);
        // With peer addresses: they round-trip, and the old form above still parses.
        let with = Descriptor {
            addresses: vec![
                "10.0.0.2:50052".into(),
                "[fd00::2]:50052".into(),
                "node-a:7".into(),
            ],
            ..d.clone()
        };
        let w = with.encode();
        assert!(
            w.starts_with(&s) && w.ends_with("@10.0.0.2:50052,[fd00::2]:50052,node-a:7"),
            "{w}"
        );
        assert_eq!(Descriptor::parse("remote_descriptor", &w).unwrap(), with);
        for bad in [
            "",
            "tcpxd2:a:1:2:abababababababababababababababab",
            "tcpxd1:a:x:2:abababababababababababababababab",
            "tcpxd1:a:1:-2:abababababababababababababababab",
            "tcpxd1:a:1:2:zz",
            "tcpxd1:a:1:2:abab",
            "tcpxd1:a b:1:2:abababababababababababababababab",
            "tcpxd1:a:1:2:abababababababababababababababab:extra",
            "tcpxd1:a:1:2:abababababababababababababababab@",
            "tcpxd1:a:1:2:abababababababababababababababab@10.0.0.2",
            "tcpxd1:a:1:2:abababababababababababababababab@10.0.0.2:0",
            "tcpxd1:a:1:2:abababababababababababababababab@0.0.0.0:5",
            "tcpxd1:a:1:2:abababababababababababababababab@h:1,,h:2",
            "tcpxd1:a:1:2:abababababababababababababababab@h:1@h:2",
            "tcpxd1:a:1:2:abababababababababababababababab@h:1,h:2,h:3,h:4,h:5,h:6,h:7,h:8,h:9",
        ] {
            let e = Descriptor::parse("remote_descriptor", bad).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument);
            assert!(
                e.message.starts_with("remote_descriptor: malformed descriptor"),
                "{e}"
            );
            assert!(!e.message.contains("abababab"), "the key never appears in errors");
        }
        assert!(!format!("{d:?}").contains("ab"), "Debug hides the key");
        let long = format!("{s}@{}:1", "a".repeat(4000));
        let e = Descriptor::parse("entries[3].remote_descriptor", &long).unwrap_err();
        assert!(
            e.message.starts_with("entries[3].remote_descriptor: ") && e.message.contains("limit of 2560"),
            "{e}"
        );
        let e = Descriptor::parse("f", &format!("{s}@h:1,x y:2")).unwrap_err();
        assert!(e.message.contains("peer address[1]"), "{e}");
    }

    #[test]
    fn host_buffers_are_resident_once_registered() {
        let reg = BufferRegistry::new("n", 1 << 30);
        let b = reg.allocate_host(64 << 20, "").unwrap();
        let (resident, pages) = b.host_region().unwrap().resident_pages().unwrap();
        assert_eq!(resident, pages, "every page is in RAM before the first transfer");
    }

    #[test]
    fn fill_checksum_and_ranges() {
        let reg = BufferRegistry::new("n", 1 << 30);
        let b = reg.allocate_host(3 * SCRATCH as u64 + 17, "x").unwrap();
        fill(&b, 0, b.size, &Pattern::Seed(7)).unwrap();
        let mut expect = vec![0u8; b.size as usize];
        seeded_bytes(7, 0, &mut expect);
        assert_eq!(read(&b, 0, b.size).unwrap(), expect);
        assert_eq!(checksum(&b, 0, b.size).unwrap(), crc32c::crc32c(&expect));
        // Sub-ranges of the seeded pattern depend only on position.
        let mut part = vec![0u8; 100];
        seeded_bytes(7, 5000, &mut part);
        assert_eq!(part, expect[5000..5100]);
        fill(&b, 10, 5, &Pattern::Repeat(vec![1, 2])).unwrap();
        assert_eq!(read(&b, 10, 5).unwrap(), vec![1, 2, 1, 2, 1]);
        fill(&b, 0, 3, &Pattern::Byte(9)).unwrap();
        assert_eq!(read(&b, 0, 3).unwrap(), vec![9, 9, 9]);
        assert_eq!(resolve_range(&b, 10, 0, true).unwrap(), (10, b.size - 10));
        assert!(resolve_range(&b, b.size + 1, 0, true).is_err());
        assert!(
            resolve_range(&b, 1, u64::MAX, false)
                .unwrap_err()
                .message
                .contains("overflows")
        );
        assert!(
            resolve_range(&b, 1, b.size, false)
                .unwrap_err()
                .message
                .contains("past the end")
        );
    }

    #[test]
    fn host_buffers_past_the_nodes_memory_are_refused_and_nothing_is_pending_after() {
        // 9 MiB available, 1 MiB kept free: 8 MiB fit, in whole pages.
        let probe = Box::new(|| Some(9 << 20));
        let reg = BufferRegistry::new("n", 1 << 40).with_headroom(Headroom::with_probe(1 << 20, probe));
        let e = reg.allocate_host((8 << 20) + 1, "").unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted);
        assert!(
            e.message.starts_with("host.size: faulting in 8392704 bytes"),
            "{e}"
        );
        assert!(e.message.contains("at most 8388608 bytes fit now"), "{e}");
        let b = reg.allocate_host(8 << 20, "").unwrap();
        assert_eq!(b.size, 8 << 20);
        let b2 = reg.allocate_host(8 << 20, "").unwrap();
        drop((b, b2)); // each was admitted alone: nothing stays pending after a registration
    }

    #[test]
    fn allocation_limits() {
        let reg = BufferRegistry::new("n", 1 << 20);
        assert_eq!(reg.allocate_host(0, "").unwrap_err().code, Code::InvalidArgument);
        assert!(
            reg.allocate_host((1 << 20) + 1, "")
                .unwrap_err()
                .message
                .contains("max_buffer_bytes")
        );
        assert!(
            reg.allocate_host(1, &"x".repeat(129))
                .unwrap_err()
                .message
                .contains("label")
        );
        let a = reg.allocate_host(10, "").unwrap();
        let b = reg.allocate_host(10, "").unwrap();
        assert_ne!(a.id, b.id);
        assert_ne!(a.key(), b.key());
        assert!(reg.get(a.id).is_err(), "not visible before publish");
        reg.publish(a.clone()).unwrap();
        assert_eq!(reg.get(a.id).unwrap().id, a.id);
        let named = reg.allocate_host(10, "kv-cache").unwrap();
        reg.publish(named).unwrap();
        let again = reg.allocate_host(10, "kv-cache").unwrap();
        assert_eq!(reg.publish(again).unwrap_err().code, Code::AlreadyExists);
        assert_eq!(reg.list().len(), 2);
        assert!(reg.remove(a.id).is_some());
    }
}
