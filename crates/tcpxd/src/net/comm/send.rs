//! The sending side: `SendComm`, its window of 16 in-flight sends and their test order.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::RequestId;
use super::comm_core::{CommCore, MemHandle, register, test_raw};
use crate::net::abi;
use crate::net::error::{NetError, NetResult};
use crate::net::logger;
use crate::net::memory::Region;
use crate::net::plugin::Plugin;

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
    pub(super) fn new(core: Arc<CommCore>) -> SendComm {
        SendComm {
            core,
            inflight: VecDeque::with_capacity(abi::MAX_REQUESTS),
            next_id: 0,
            sizes_written: 0,
        }
    }

    pub fn dev(&self) -> i32 {
        self.core.dev
    }

    /// A number naming this comm in the hop trace (`tcpxd::hop`): its requests are FIFO, so a
    /// trace's k-th post on a comm is its k-th completion (`benches/chunks.py`).
    pub fn trace_id(&self) -> usize {
        Arc::as_ptr(&self.core) as usize
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
