//! Daemon-allocated CUDA memory that outlives the daemon (docs/OPERATIONS.md, "Restarts"): with
//! a state directory and a descriptor store (src/fd_store.rs), `RegisterBuffer` cuda allocates
//! with the VMM API (gpu/vmm.rs) and hands the allocation's fd to the store as
//! `tcpxd-cuda-b<id>`; the journal records its id, key, size and device. At the next start the
//! daemon maps each kept fd again under the buffer's id and key, bytes as they were; a release
//! takes the fd out of the store.
//!
//! Such a buffer has no CUDA IPC handle (`cuIpcGetMemHandle` does not serve VMM allocations):
//! its `cuda_ipc_handle` is empty.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use crate::buffers::{BufferEntry, BufferKind, BufferMemory, BufferRegistry, Ident};
use crate::engine::{Code, EngineError};
use crate::fd_store::{CudaStore, FdStore, fd_name};
use crate::journal::KeptCuda;

impl BufferRegistry {
    /// Keeps daemon-allocated CUDA memory's fds in `store`.
    pub fn with_cuda_store(mut self, store: FdStore) -> BufferRegistry {
        self.cuda_store = Some(CudaStore::new(store));
        self
    }

    /// Whether CUDA buffers this registry allocates outlive the process.
    pub fn keeps_cuda(&self) -> bool {
        self.cuda_store.is_some()
    }

    /// The device of buffer `b` when its fd is kept (the journal records it), else `None`.
    pub(crate) fn kept_cuda_device(&self, b: &BufferEntry) -> Option<u32> {
        let store = self.cuda_store.as_ref()?;
        if !store.kept().contains(&b.id) {
            return None;
        }
        match &b.memory {
            BufferMemory::Cuda { region, .. } => Some(region.gpu().ordinal() as u32),
            BufferMemory::Host(_) | BufferMemory::Client => None,
        }
    }

    /// Allocates `size` bytes of CUDA memory on `device` with the VMM API and hands its fd to
    /// the store ([`BufferRegistry::allocate_cuda`] where the registry has none).
    pub fn allocate_cuda_kept(
        &self,
        device: u32,
        size: u64,
        label: &str,
    ) -> Result<Arc<BufferEntry>, EngineError> {
        let Some(store) = &self.cuda_store else {
            return self.allocate_cuda(device, size, label);
        };
        self.check_new("cuda.size", size, label)?;
        let gpu = self.gpu("cuda.device", device)?;
        if store.kept().len() >= store.store.max {
            return Err(EngineError::new(
                Code::ResourceExhausted,
                format!(
                    "cuda: the service manager keeps at most {} descriptors (FileDescriptorStoreMax=, \
                     FDSTORE) and every one holds a CUDA buffer: release one, or raise the limit",
                    store.store.max
                ),
            ));
        }
        let (region, fd) = gpu.alloc_shareable(size as usize).map_err(|e| {
            EngineError::new(
                Code::ResourceExhausted,
                format!("cuda.size: cannot allocate {size} bytes that outlive the daemon: {e}"),
            )
        })?;
        let id = self.new_id();
        store.store.store(&fd_name(id), fd.as_fd()).map_err(|e| {
            EngineError::new(
                Code::Unavailable,
                format!("cuda: handing the allocation's descriptor to the service manager's store: {e}"),
            )
        })?;
        store.kept().insert(id);
        Ok(self.entry_as(
            BufferKind::Cuda,
            size,
            label,
            BufferMemory::Cuda {
                region: Arc::new(region),
                export: None,
                imported_from: None,
            },
            Some(Ident {
                id,
                key: rand::random(),
            }),
        ))
    }

    /// The previous instance's CUDA buffer `kept` from its fd (which the store still holds): its
    /// memory mapped again, bytes as they were, under its id and key.
    pub fn restore_cuda(&self, kept: &KeptCuda, fd: OwnedFd) -> Result<Arc<BufferEntry>, EngineError> {
        let gpu = self.gpu("cuda.device", kept.device)?;
        let region = gpu
            .import_shareable(fd.as_fd(), kept.size as usize)
            .map_err(|e| {
                EngineError::new(
                    Code::Internal,
                    format!("mapping the kept CUDA memory of buffer {}: {e}", kept.id),
                )
            })?;
        if let Some(store) = &self.cuda_store {
            store.kept().insert(kept.id);
        }
        Ok(self.entry_as(
            BufferKind::Cuda,
            kept.size,
            &kept.label,
            BufferMemory::Cuda {
                region: Arc::new(region),
                export: None,
                imported_from: None,
            },
            Some(Ident {
                id: kept.id,
                key: kept.key,
            }),
        ))
    }

    /// Buffer `id` was released: its fd leaves the store (the memory is freed once the last
    /// mapping goes).
    pub fn forget_kept_cuda(&self, id: u64) {
        let Some(store) = &self.cuda_store else {
            return;
        };
        if store.kept().remove(&id)
            && let Err(e) = store.store.remove(&fd_name(id))
        {
            tracing::warn!(
                buffer = id,
                "taking a CUDA buffer's descriptor out of the store: {e}"
            );
        }
    }
}
