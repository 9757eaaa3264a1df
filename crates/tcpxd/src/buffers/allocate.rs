//! Making a buffer's memory: daemon-allocated host memory (anonymous, or a file of the state
//! directory's `host/`), daemon-allocated CUDA memory, a client's CUDA allocation by IPC handle, a
//! client's pages by address, and a previous instance's host file (re-attach).

use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::{BufferEntry, BufferKind, BufferMemory, BufferRegistry, Ident};
use crate::engine::{Code, EngineError};
use crate::gpu::{DeviceRegion, Gpu};
use crate::net::cross_memory::ClientPages;
use crate::net::{HostRegion, REGION_ALIGN};

impl BufferRegistry {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headroom::Headroom;

    #[test]
    fn host_buffers_are_resident_once_registered() {
        let reg = BufferRegistry::new("n", 1 << 30);
        let b = reg.allocate_host(64 << 20, "").unwrap();
        let (resident, pages) = b.host_region().unwrap().resident_pages().unwrap();
        assert_eq!(resident, pages, "every page is in RAM before the first transfer");
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
}
