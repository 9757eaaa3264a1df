//! The daemon's buffers: ids and access keys, the limits a new buffer is checked against, making
//! a buffer visible (`publish`) and finding it again. Making a buffer's memory is `allocate.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{BufferEntry, BufferKind, BufferMemory, Descriptor, MAX_LABEL_BYTES};
use crate::engine::{Code, EngineError};
use crate::headroom::{DEFAULT_RESERVE, Headroom};

/// The buffers of this daemon. The poller keeps its own copy of each entry it uses.
pub struct BufferRegistry {
    node_id: String,
    /// The peer addresses every descriptor carries (`peer.advertise`).
    advertise: Vec<String>,
    max_buffer_bytes: u64,
    /// What a host registration may fault in (`transfer.host_memory_reserve_bytes`).
    pub(crate) headroom: Headroom,
    pub(super) next_id: AtomicU64,
    map: Mutex<HashMap<u64, Arc<BufferEntry>>>,
    /// Where daemon-allocated host memory lives as files (the state directory's `host/`, on
    /// tmpfs): its bytes outlive the process. `None`: anonymous memory.
    pub(super) host_dir: Option<std::path::PathBuf>,
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

    /// Like [`BufferRegistry::get`], naming the request's field in the error (`entries[0].local_buffer_id`).
    pub fn get_as(&self, field: &str, id: u64) -> Result<Arc<BufferEntry>, EngineError> {
        self.get_named(id, || field.to_string())
    }

    /// Like [`BufferRegistry::get_as`], the field's name made only for the error (a batch's
    /// `entries[i].local_buffer_id`, formatted only when buffer `id` does not exist).
    pub fn get_named(
        &self,
        id: u64,
        field: impl FnOnce() -> String,
    ) -> Result<Arc<BufferEntry>, EngineError> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| EngineError::not_found(format!("{}: buffer {id} does not exist", field())))
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

#[cfg(test)]
mod tests {
    use super::*;

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
