//! The lane threads' receive half (`runtime.lane_thread`, session 31): a receive lane's comm,
//! once accepted, is driven on the lane thread of the GPU it was accepted under, with everything
//! a receive needs from its post to its `irecvConsumed` — the registrations, the landing slots of
//! credit receives and the host landing ring of block chunks, the posts the plugin could not take
//! yet, the unpack (host copies, or this thread's own [`GpuStage`] per GPU) and the consume in
//! ring order. The poller keeps the engine: it hands each receive over with what its unpack needs
//! (the destination's entry and offset, a block chunk's pieces fixed at its post, the offer's
//! [`Lands`] flag), orders an eager chunk's landing once its header named the destination
//! ([`RecvOrder::Land`]), and hears back, in ring order per lane, that a credit receive completed
//! ([`LaneEvent::Landed`]) and that a receive was consumed ([`LaneEvent::Consumed`], its
//! outcome and, for a block chunk, its name). docs/ARCHITECTURE.md, "The lane threads".
//!
//! # State
//! Per receive lane (pairing, lane, generation): the `RecvComm`, its registrations by (buffer,
//! window), the landing slots, the landing ring and its slot map (released here when a receive
//! in it is consumed), the receives waiting for a plugin slot and the posted and completed ones
//! ([`RecvQueue`], in ring order) with what each is for. The engine's window bounds what the
//! poller hands over (`recv_window + scatter_ahead` per lane); this thread posts at most
//! `recv_window` of them, as the poller's `post_recvs` did, and posts the next as soon as a
//! plugin slot comes back (a receive whose copies read only its own landing slot gives its slot
//! back before they end: `Wait::Slot`).
//!
//! # Shutdown
//! A lane's close ([`ToLanes::CloseRecv`]), a failed pairing's (`apart`: on the closer threads),
//! the poller's stop and a panic treat receive lanes as send lanes; before a receive lane's comm
//! closes here, the kernels of this thread's stages that read a bounce buffer or a scatter table
//! and the host copies that read its pages are let finish.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::{Driver, Key, LaneEvent, panic_hook_due};
use crate::buffers::BufferEntry;
use crate::engine::blocks::Segment;
use crate::lanes::{self, GpuStage, RecvQueue, Wait};
use crate::net::host_copies::HostCopies;
use crate::net::{MemHandle, RecvComm};
use crate::poller::blocks::{self, RecvScatter, ScatterTo};
use crate::poller::posting::{Placed, handle_for_entry, make_landing, start_entry_unpack};
use crate::unpack::UnpackImpl;

/// Whether an offer's receives still land (`Engine::recv_lands`): set by the poller, false once
/// the engine discards the offer (cancelled, failed); read when a receive of it completes.
pub(in crate::poller) type Lands = Arc<AtomicBool>;

/// What the receive lanes here need to know of the poller's configuration.
pub(in crate::poller) struct RecvSetup {
    /// Receives the plugin gets per lane (`transfer.recv_window`).
    pub recv_window: usize,
    /// A lane's host landing ring slots (`recv_window + scatter_ahead`).
    pub landing: u64,
    pub unpack_impl: UnpackImpl,
    /// The daemon's host copy helpers (shared with the poller).
    pub copies: Arc<HostCopies>,
}

/// What a receive is posted for.
pub(in crate::poller) enum Into {
    /// A plain chunk into a buffer at this offset (its window registered here on first use),
    /// unpacked there while its offer `lands`.
    Buffer {
        entry: Arc<BufferEntry>,
        offset: u64,
        lands: Lands,
    },
    /// A block chunk (or a plain chunk into a buffer registered by address: one piece), with the
    /// pieces the engine gave at its post: into the host landing ring (host memory) or anchored
    /// in the buffer's registration (GPU memory), scattered once complete.
    Scatter {
        entry: Arc<BufferEntry>,
        to: ScatterTo,
        pieces: Result<Vec<Segment>, String>,
        lands: Lands,
    },
    /// An eager credit receive into the lane's landing slots (made on first use: `credits` of
    /// the receive's size, or one GPU page with `gpu_landing`); `Land` says where it goes.
    Credit { credits: u64, gpu_landing: bool },
    /// A chunk of a transfer that ended here (`PostDropRecv`): into the landing ring, never
    /// unpacked.
    Drop,
}

/// Where an eager chunk goes, once its header said (`Action::Land`, `LandScatter`).
pub(in crate::poller) enum LandTo {
    /// Refused or cancelled: consumed without unpacking, its slot zeroed.
    Discard,
    Buffer {
        entry: Arc<BufferEntry>,
        offset: u64,
        len: u32,
    },
    Scatter {
        entry: Arc<BufferEntry>,
        to: ScatterTo,
        len: u32,
        pieces: Result<Vec<Segment>, String>,
    },
    /// Its destination is gone: the receive fails (the engine fails its transfer), zeroed.
    Failed(String),
}

/// The poller's orders about a receive lane.
pub(in crate::poller) enum RecvOrder {
    /// One receive of `len` bytes, after the lane's earlier ones.
    Post { into: Into, len: u32 },
    /// The oldest completed credit receive waiting for its header goes here.
    Land(LandTo),
}

/// A receive taken from the poller: what it is for and where it is posted.
struct Held {
    into: Into,
    len: u32,
    /// The host landing ring slot it was given (released when it is consumed).
    ring_slot: Option<u64>,
    /// Posted at this offset of the landing slots (credit receives).
    credit_at: u64,
}

/// A completed receive's bookkeeping until it is consumed.
#[derive(Debug)]
struct Meta {
    landed: Instant,
    unpacked: Option<Instant>,
    on_host: bool,
    ring_slot: Option<u64>,
    chunk: Option<(u64, u64)>,
    /// Keeps the destination mapped until the receive is consumed.
    _entry: Option<Arc<BufferEntry>>,
}

/// A receive lane driven here.
pub(in crate::poller) struct RLane {
    pub(super) epoch: u64,
    pub(super) gpu: Option<u32>,
    pub(super) failed: bool,
    // The registrations go before the comm (each holds it open until it goes).
    handles: HashMap<(u64, u64), MemHandle>,
    landing_slots: Option<MemHandle>,
    landing_on_gpu: bool,
    credit_seq: u64,
    scatter: RecvScatter,
    queue: RecvQueue<(), Meta>,
    /// What each posted receive is for, in the queue's order.
    posts: VecDeque<Held>,
    /// Receives waiting for a plugin slot, in order.
    deferred: VecDeque<Held>,
    comm: RecvComm,
    /// The flow-steering rules' record: dropped after the comm, whose close removed them.
    _rules: Option<crate::rx_rules::Recorded>,
}

impl RLane {
    pub(in crate::poller) fn new(
        epoch: u64,
        gpu: Option<u32>,
        comm: RecvComm,
        rules: Option<crate::rx_rules::Recorded>,
    ) -> RLane {
        RLane {
            epoch,
            gpu,
            failed: false,
            handles: HashMap::new(),
            landing_slots: None,
            landing_on_gpu: false,
            credit_seq: 0,
            scatter: RecvScatter::default(),
            queue: RecvQueue::default(),
            posts: VecDeque::new(),
            deferred: VecDeque::new(),
            comm,
            _rules: rules,
        }
    }

    /// The GPU its comm was accepted under (closed under it).
    pub(in crate::poller) fn gpu(&self) -> Option<u32> {
        self.gpu
    }

    /// Forgets a removed buffer's registrations.
    pub(super) fn forget(&mut self, buffers: &[u64]) {
        self.handles.retain(|(b, _), _| !buffers.contains(b));
    }

    /// Whether this thread must keep testing the lane: receives being unpacked or waiting for a
    /// slot, or posted while the poller's engine expects bytes (`expecting`: idle credit
    /// receives alone do not keep the thread awake).
    pub(super) fn busy(&self, expecting: bool) -> bool {
        !self.failed
            && (self.queue.landed() > 0
                || !self.deferred.is_empty()
                || (expecting && self.queue.posted() > 0))
    }

    /// Whether a GPU kernel of this thread's stages may read the lane's scatter tables.
    pub(super) fn on_gpu(&self) -> bool {
        self.scatter.on_gpu()
    }
}

impl Driver {
    /// Carries out an order about receive lane `key`.
    pub(super) fn recv_order(&mut self, key: Key, epoch: u64, order: RecvOrder) {
        let Some(l) = self.recv.get_mut(&key).filter(|l| l.epoch == epoch && !l.failed) else {
            return;
        };
        let r = match order {
            RecvOrder::Post { into, len } => take_post(l, into, len, &self.setup).map(|held| {
                l.deferred.push_back(held);
            }),
            RecvOrder::Land(to) => land(l, to, &mut self.stages, &self.setup),
        };
        if let Err(why) = r {
            l.failed = true;
            self.events.push(LaneEvent::RecvFailed { key, epoch, why });
        }
    }

    /// One pass over the receive lanes: post what waits while the plugin takes it, test the
    /// head of each comm (a completed receive starts its unpack), launch each GPU's batch,
    /// consume in ring order what is unpacked, and post into the slots that came back.
    pub(super) fn recv_pass(&mut self) -> bool {
        if self.recv.is_empty() {
            return false;
        }
        let mut progressed = false;
        let Driver {
            recv,
            stages,
            events,
            setup,
            metrics,
            posts,
            ..
        } = self;
        for (&key, l) in recv.iter_mut() {
            if l.failed {
                continue;
            }
            let r = post_deferred(l, setup.recv_window, posts).and_then(|()| {
                let RLane {
                    queue,
                    comm,
                    posts: held,
                    scatter,
                    ..
                } = l;
                queue
                    .test_heads(comm, |comm, posted| {
                        let h = held.pop_front().expect("what each posted receive is for");
                        let (wait, meta) = start(comm, posted.id, h, scatter, stages, setup);
                        if matches!(wait, Wait::Header) {
                            events.push(LaneEvent::Landed { key, epoch: l.epoch });
                        }
                        (wait, meta)
                    })
                    .map_err(|e| {
                        metrics.plugin_error(&e);
                        e.to_string()
                    })
            });
            match r {
                Ok(n) => progressed |= n > 0,
                Err(why) => {
                    l.failed = true;
                    progressed = true;
                    events.push(LaneEvent::RecvFailed {
                        key,
                        epoch: l.epoch,
                        why,
                    });
                }
            }
        }
        for stage in stages.values_mut() {
            stage.advance();
        }
        progressed |= self.consume();
        progressed
    }

    /// Consumes each lane's completed receives whose unpack is over, in ring order (reported as
    /// [`LaneEvent::Consumed`]), then posts the receives waiting into the slots that came back.
    pub(super) fn consume(&mut self) -> bool {
        let mut progressed = false;
        let Driver {
            recv,
            stages,
            events,
            setup,
            metrics,
            posts,
            ..
        } = self;
        for (&key, l) in recv.iter_mut() {
            if l.failed || l.queue.landed() == 0 {
                continue;
            }
            let epoch = l.epoch;
            let RLane {
                queue, comm, scatter, ..
            } = l;
            let cid = comm.trace_id();
            let consumed = queue.consume_ready(
                comm,
                |gpu, batch| stages.get(&gpu).and_then(|s| s.outcome(batch)),
                |front, result| {
                    tracing::trace!(target: "tcpxd::hop", hop = "lanes.consumed", pass = crate::lanes::pass(), lane = key.1, comm = cid);
                    let now = Instant::now();
                    let m = front.meta;
                    let kind = if m.on_host { "host" } else { "gpu" };
                    metrics.recv_consumed(kind, m.unpacked.unwrap_or(now) - m.landed, now - m.landed);
                    if let Some(at) = m.ring_slot {
                        scatter.release(at);
                    }
                    events.push(LaneEvent::Consumed {
                        key,
                        epoch,
                        chunk: m.chunk,
                        result,
                    });
                },
            );
            let r = match consumed {
                Ok(n) => {
                    progressed |= n > 0;
                    post_deferred(l, setup.recv_window, posts)
                }
                Err(e) => {
                    metrics.plugin_error(&e);
                    Err(format!("irecvConsumed: {e}"))
                }
            };
            if let Err(why) = r {
                l.failed = true;
                progressed = true;
                events.push(LaneEvent::RecvFailed { key, epoch, why });
            }
        }
        progressed
    }

    /// Before a receive lane's comm closes here or apart: the kernels of this thread's stages
    /// that read scatter tables or bounce pages, and the host copies, are let finish.
    pub(super) fn quiesce_for(&mut self, l: &RLane) {
        if l.on_gpu() {
            self.stages.values_mut().for_each(GpuStage::quiesce_blocks);
        }
        self.setup.copies.quiesce();
    }
}

/// Where a receive taken from the poller is posted: credit receives in the landing slots (made
/// on first use), host block chunks and dropped chunks in the landing ring.
fn take_post(l: &mut RLane, into: Into, len: u32, setup: &RecvSetup) -> Result<Held, String> {
    let mut held = Held {
        into,
        len,
        ring_slot: None,
        credit_at: 0,
    };
    match &held.into {
        Into::Buffer { .. } => {}
        Into::Credit { credits, gpu_landing } => {
            if l.landing_slots.is_none() {
                let (mh, on_gpu) = make_landing(&l.comm, l.gpu, *credits, len, *gpu_landing)
                    .map_err(|why| format!("credit receive: {why}"))?;
                // (The GPU landing registration bound its GPU: the lane's.)
                l.landing_slots = Some(mh);
                l.landing_on_gpu = on_gpu;
            }
            let slot = l.credit_seq % (*credits).max(1);
            l.credit_seq += 1;
            // A GPU landing registration: every credit receive names its start.
            held.credit_at = if l.landing_on_gpu {
                0
            } else {
                slot * u64::from(len)
            };
        }
        Into::Scatter { entry, .. } if entry.gpu().is_some() => {
            if len > crate::engine::MAX_CHUNK_BYTES {
                return Err(format!(
                    "block receive: a {len}-byte chunk is over {} bytes",
                    crate::engine::MAX_CHUNK_BYTES
                ));
            }
            if u64::from(len) > entry.size {
                return Err(format!(
                    "block receive: a {len}-byte chunk into the {}-byte buffer {}",
                    entry.size, entry.id
                ));
            }
        }
        Into::Scatter { .. } | Into::Drop => {
            held.ring_slot = Some(
                blocks::ring_slot(&l.comm, &mut l.scatter, len, setup.landing)
                    .map_err(|why| format!("receive: {why}"))?,
            );
        }
    }
    Ok(held)
}

/// Posts the lane's waiting receives in order while the plugin takes them and holds fewer than
/// `window` of the lane's receives.
fn post_deferred(l: &mut RLane, window: usize, posts: &mut u64) -> Result<(), String> {
    while l.comm.outstanding() < window
        && let Some(h) = l.deferred.front()
    {
        let (mh, at) = match (&h.into, h.ring_slot) {
            (_, Some(slot)) => (
                l.scatter
                    .landing()
                    .ok_or("a block receive without its landing ring")?,
                slot,
            ),
            (Into::Credit { .. }, None) => (
                l.landing_slots
                    .as_ref()
                    .ok_or("credit receive without landing slots")?,
                h.credit_at,
            ),
            (Into::Buffer { entry, offset, .. }, None) => {
                let comm = &l.comm;
                let r = handle_for_entry(&mut l.handles, entry, *offset, |r| comm.register(r))?;
                // A registration binds the buffer's context: the lane's GPU is current again
                // for the plugin's calls on its comm.
                crate::topology::make_current(l.gpu)?;
                r
            }
            (Into::Scatter { entry, .. }, None) => {
                // GPU memory: the data pointer only anchors the request in a registration.
                let comm = &l.comm;
                let r = handle_for_entry(&mut l.handles, entry, 0, |r| comm.register(r))?;
                crate::topology::make_current(l.gpu)?;
                r
            }
            (Into::Drop, None) => return Err("a dropped receive without a landing slot".into()),
        };
        if !l
            .queue
            .post(&mut l.comm, mh, at as usize, h.len, ())
            .map_err(|e| e.to_string())?
        {
            break;
        }
        let h = l.deferred.pop_front().expect("the front");
        l.posts.push_back(h);
        *posts += 1;
        if panic_hook_due(*posts) {
            panic!("TCPXD_TEST_LANE_THREAD_PANIC_AT: post {posts}");
        }
    }
    Ok(())
}

/// A completed receive's unpack, started as the poller's `test_lanes` did.
fn start(
    comm: &RecvComm,
    id: crate::net::RequestId,
    h: Held,
    scatter: &mut RecvScatter,
    stages: &mut HashMap<usize, GpuStage>,
    setup: &RecvSetup,
) -> (Wait, Meta) {
    let landed = Instant::now();
    let staged = h.ring_slot.is_some();
    let mut chunk = None;
    let mut keep = None;
    let wait = match h.into {
        // Eager: where it goes comes with its header (`Land`).
        Into::Credit { .. } => Wait::Header,
        Into::Drop => lanes::discard(comm, id),
        Into::Buffer { lands, .. } | Into::Scatter { lands, .. } if !lands.load(Ordering::Acquire) => {
            // Its transfer ended here since it was posted: nothing reaches the destination;
            // what a landing slot holds is zeroed.
            if staged {
                lanes::discard(comm, id)
            } else {
                Wait::Ready(Ok(()))
            }
        }
        Into::Buffer { entry, offset, .. } => {
            let dest = Placed {
                buffer: entry.id,
                offset,
                len: h.len,
                staged: false,
            };
            let w = start_entry_unpack(comm, id, dest, &entry, stages, setup.unpack_impl);
            keep = Some(entry);
            w
        }
        Into::Scatter {
            entry, to, pieces, ..
        } => {
            if to.direct.is_none() {
                chunk = Some((to.offer, to.wire));
            }
            let w = match pieces {
                Ok(segs) => blocks::start_scatter(
                    comm,
                    id,
                    to,
                    h.len,
                    &segs,
                    Some(&entry),
                    stages,
                    setup.unpack_impl,
                    &setup.copies,
                    scatter,
                ),
                Err(why) => {
                    if staged {
                        let _ = comm.zero_posted(id, h.len as usize);
                    }
                    Wait::Ready(Err(why))
                }
            };
            keep = Some(entry);
            w
        }
    };
    let meta = Meta {
        landed,
        unpacked: matches!(wait, Wait::Ready(_)).then(Instant::now),
        on_host: wait.on_host(),
        ring_slot: h.ring_slot,
        chunk,
        _entry: keep,
    };
    (wait, meta)
}

/// `Land` / `LandScatter`: the lane's oldest completed credit receive still waiting for its
/// header gets its unpack (as the poller's `landed_chunk`).
fn land(
    l: &mut RLane,
    to: LandTo,
    stages: &mut HashMap<usize, GpuStage>,
    setup: &RecvSetup,
) -> Result<(), String> {
    let RLane {
        queue, comm, scatter, ..
    } = l;
    let Some(landing) = queue.awaiting_header() else {
        return Err("a chunk landed with no completed receive".into());
    };
    let id = landing.id;
    let wait = match to {
        LandTo::Discard => lanes::discard(comm, id),
        LandTo::Failed(why) => {
            let _ = comm.zero_posted(id, usize::MAX);
            Wait::Ready(Err(why))
        }
        LandTo::Buffer { entry, offset, len } => {
            let dest = Placed {
                buffer: entry.id,
                offset,
                len,
                staged: true,
            };
            let w = start_entry_unpack(comm, id, dest, &entry, stages, setup.unpack_impl);
            landing.meta._entry = Some(entry);
            w
        }
        LandTo::Scatter {
            entry,
            to,
            len,
            pieces,
        } => {
            let w = match pieces {
                // Landed in GPU bounce pages (a GPU landing registration): scattered from there
                // as a block receive's chunk is.
                Ok(segs) if comm.posted_on_gpu(id).unwrap_or(false) => blocks::start_scatter(
                    comm,
                    id,
                    to,
                    len,
                    &segs,
                    Some(&entry),
                    stages,
                    setup.unpack_impl,
                    &setup.copies,
                    scatter,
                ),
                pieces => {
                    let r = pieces.and_then(|segs| {
                        blocks::land_scatter(
                            comm,
                            id,
                            &entry,
                            len,
                            &segs,
                            stages,
                            setup.unpack_impl,
                            &setup.copies,
                        )
                    });
                    if r.is_err() {
                        let _ = comm.zero_posted(id, len as usize);
                    }
                    Wait::Ready(r)
                }
            };
            landing.meta._entry = Some(entry);
            w
        }
    };
    if matches!(wait, Wait::Ready(_)) {
        landing.meta.unpacked = Some(Instant::now());
    }
    landing.meta.on_host = wait.on_host();
    landing.wait = wait;
    Ok(())
}
