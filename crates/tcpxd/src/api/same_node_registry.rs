//! The book of same-node transfers ([`SameNode`]): the copies in flight (their ids, cancel
//! flags and buffers) and the prepared lists over other clients' lists of this node. The
//! services' shared state holds it; `same_node.rs` runs the copies it books.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tonic::Status;

/// Ids of same-node transfers start here: far above the engine's, which count from 1.
pub const FIRST_ID: u64 = 1 << 62;

/// The same-node transfers in flight (their cancel flags), and the prepared lists over other
/// clients' lists of this node (a prepared transfer naming one as its remote list is copied).
#[derive(Default)]
pub struct SameNode {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Open>>,
    /// Told whenever a copy ends (ReleaseBuffer waits for those using its buffer).
    ended: tokio::sync::Notify,
    prepared: Mutex<std::collections::HashSet<u64>>,
}

/// A copy in flight: its cancel flag and the buffers it uses.
struct Open {
    cancel: Arc<AtomicBool>,
    buffers: Vec<u64>,
}

impl SameNode {
    /// Whether prepared list `id` names other clients' lists of this node.
    pub fn is_prepared(&self, id: u64) -> bool {
        let set = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        !set.is_empty() && set.contains(&id)
    }

    pub(crate) fn prepared(&self, id: u64) {
        self.prepared.lock().unwrap_or_else(|e| e.into_inner()).insert(id);
    }

    pub(crate) fn released(&self, id: u64) {
        self.prepared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    pub(super) fn open(&self, buffers: Vec<u64>) -> (u64, Arc<AtomicBool>) {
        let id = FIRST_ID + self.next.fetch_add(1, Ordering::Relaxed);
        let cancel = Arc::new(AtomicBool::new(false));
        self.lock().insert(
            id,
            Open {
                cancel: cancel.clone(),
                buffers,
            },
        );
        (id, cancel)
    }

    pub(super) fn close(&self, id: u64) {
        self.lock().remove(&id);
        self.ended.notify_waiters();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Open>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn in_use(&self, buffer: u64) -> bool {
        self.lock().values().any(|o| o.buffers.contains(&buffer))
    }

    /// Waits until no same-node copy uses `buffer`, or `deadline` (None: as long as it takes)
    /// passes: then FAILED_PRECONDITION, as the engine answers for its transfers.
    pub async fn idle(&self, buffer: u64, deadline: Option<Instant>) -> Result<(), Status> {
        loop {
            let ended = self.ended.notified();
            if !self.in_use(buffer) {
                return Ok(());
            }
            match deadline {
                None => ended.await,
                Some(d) => {
                    if tokio::time::timeout_at(d.into(), ended).await.is_err() && self.in_use(buffer) {
                        return Err(Status::failed_precondition(format!(
                            "buffer_id: buffer {buffer} is still in use by a transfer within this node"
                        )));
                    }
                }
            }
        }
    }

    /// Cancels a same-node transfer: `None` when `id` is not one (the poller's), `Some(false)`
    /// when it already ended.
    pub fn cancel(&self, id: u64) -> Option<bool> {
        if id < FIRST_ID {
            return None;
        }
        Some(self.lock().get(&id).is_some_and(|o| {
            o.cancel.store(true, Ordering::Relaxed);
            true
        }))
    }
}
