//! The receive comm: a ctrl reader queues the sender's headers; `test`, as Google's plugin's,
//! activates at most one posted receive per call and matches the oldest active one to its
//! header (`TCPXEMU_PROGRESS=eager`: every arrived header to every posted receive), handing
//! chunk tasks to one thread per data socket, which land the bytes in
//! shuffled bounce pages (with a fragment list in the unpack ring) or, for direct receives,
//! straight in the destination.
//!
//! Which receives bounce: in host mode, host-memory receives (unless `TCPXEMU_HOST_RECV=direct`);
//! in CUDA mode, CUDA-memory receives (device bounce pages, reached through a pinned mirror) while
//! host-memory receives are direct, as in the real plugin.
//!
//! This file is the comm and its request slots (post, match, test, consume, close); the socket
//! threads that land the bytes are in `readers`.

use crate::abi::{self, MAX_REQUESTS, NET_UNPACK_MAX_SLICE_PAGES, ncclResult_t};
use crate::config::{CloseMode, Config, Device, Fragments, HostRecv, Progress};
use crate::cuda::Ctx;
use crate::listen::Group;
use crate::memory::{BouncePool, HandleMemory, RecvStaging, RingMemory};
use crate::rng;
use crate::sockio;
use crate::sync::{Health, TaskQueue, lock};
use crate::wire::{self, Header};
use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

mod readers;
use readers::{ctrl_reader, data_thread};

/// Where a receive's bytes land.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Landing {
    /// A plain receive into the destination; `cnt[q]` stays 0.
    Direct,
    /// Shuffled bounce pages (host or device, as the pool is) plus a fragment list.
    Bounce,
}

/// The destination of a direct receive.
#[derive(Debug, Clone, Copy)]
struct DstPtr(*mut u8);
// SAFETY: NCCL's contract keeps the destination alive until the receive is consumed;
// closeRecv joins every socket thread before returning.
unsafe impl Send for DstPtr {}

#[derive(Debug)]
struct RecvTask {
    q: usize,
    size: u32,
    posted: u32,
    chunk: u32,
    start: u64,
    dst: DstPtr,
    landing: Landing,
}

/// Per-slot progress, written by the socket threads.
struct SlotShared {
    bytes: AtomicU64,
    frags: AtomicU32,
    /// Pool blocks the request holds (pages in host mode), returned at `irecvConsumed`.
    nblocks: AtomicU32,
    blocks: Box<[AtomicU32]>,
}

struct RecvShared {
    health: Health,
    ctrl: TcpStream,
    data: Vec<TcpStream>,
    queues: Vec<TaskQueue<RecvTask>>,
    headers: Mutex<VecDeque<Header>>,
    ctrl_eof: AtomicBool,
    ring: RingMemory,
    pool: BouncePool,
    slots: Vec<SlotShared>,
    /// What receives into host memory do.
    host_landing: Landing,
    /// Host mode with bounce receives: the socket threads fault the pool in before their first
    /// receive (`TCPXEMU_BOUNCE_POPULATE`).
    populate: bool,
    fragments: Fragments,
    /// Set when the comm's GPU is one its NIC does not serve (listen was called under it): why.
    /// Its CUDA receives fail with the plugin's "rx no cmsg" as their bytes arrive.
    misbound: Option<String>,
    label: String,
}

impl RecvShared {
    fn shutdown_all(&self) {
        let _ = self.ctrl.shutdown(Shutdown::Both);
        for s in &self.data {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn socket_error(&self, e: &io::Error) {
        if self.health.closing() {
            return;
        }
        if sockio::is_peer_closed(e) {
            self.peer_closed();
        } else {
            self.health.fail(
                abi::NCCL_SYSTEM_ERROR,
                format!("tcpxemu: {} data read failed: {e}", self.label),
            );
        }
    }

    fn peer_closed(&self) {
        self.health.fail(
            abi::NCCL_SYSTEM_ERROR,
            format!("tcpxemu: Connection closed by remote peer ({})", self.label),
        );
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Free,
    Posted,
    Done,
}

#[derive(Debug, Clone, Copy)]
struct RecvReq {
    status: Status,
    posted: u32,
    size: u32,
    dst: *mut u8,
    landing: Landing,
}

/// Request counters, each ≥ the next: `tail` (irecv), `activated` (a test took it from
/// posted), `matched` (its header read, its chunk tasks queued), `done` (tested done), `head`
/// (consumed).
struct RecvState {
    tail: u64,
    activated: u64,
    matched: u64,
    done: u64,
    head: u64,
    chunk_counter: u64,
    reqs: [RecvReq; MAX_REQUESTS],
}

pub(crate) struct RecvComm {
    shared: Arc<RecvShared>,
    handle: HandleMemory,
    has_devcomm: bool,
    state: Mutex<RecvState>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// `TCPXEMU_PROGRESS=eager`: a test matches every arrived header.
    eager: bool,
}

impl RecvComm {
    pub(crate) fn new(
        group: Group,
        dev: &'static Device,
        cfg: &Config,
        has_devcomm: bool,
        salt: u64,
        cuda: Option<&Arc<Ctx>>,
        misbound: Option<String>,
    ) -> io::Result<RecvComm> {
        let Group { ctrl, data, peer, .. } = group;
        let n = data.len();
        let pool_rng = rng::derive(cfg.seed, salt);
        let (ring, pool, handle, mut stagings, host_landing) = match cuda {
            None => {
                let ring = RingMemory::new()?;
                let pool = BouncePool::new(cfg.bounce_pages, cfg.host_block_pages, pool_rng)?;
                let handle = HandleMemory::new(&ring, &pool);
                let host_landing = match cfg.host_recv {
                    HostRecv::Bounce => Landing::Bounce,
                    HostRecv::Direct => Landing::Direct,
                };
                (ring, pool, handle, Vec::new(), host_landing)
            }
            Some(ctx) => {
                let ring = RingMemory::new_cuda(ctx)?;
                let pool = BouncePool::new_cuda(ctx, cfg.bounce_pages, pool_rng)?;
                let handle = HandleMemory::new_cuda(ctx, &ring, &pool)?;
                let stagings = (0..n)
                    .map(|_| RecvStaging::new(ctx))
                    .collect::<io::Result<Vec<_>>>()?;
                (ring, pool, handle, stagings, Landing::Direct)
            }
        };
        let shared = Arc::new(RecvShared {
            health: Health::default(),
            ctrl,
            data,
            queues: (0..n).map(|_| TaskQueue::new()).collect(),
            headers: Mutex::new(VecDeque::with_capacity(4 * MAX_REQUESTS)),
            ctrl_eof: AtomicBool::new(false),
            ring,
            pool,
            slots: (0..MAX_REQUESTS)
                .map(|_| SlotShared {
                    bytes: AtomicU64::new(0),
                    frags: AtomicU32::new(0),
                    nblocks: AtomicU32::new(0),
                    blocks: (0..NET_UNPACK_MAX_SLICE_PAGES)
                        .map(|_| AtomicU32::new(0))
                        .collect(),
                })
                .collect(),
            host_landing,
            populate: cuda.is_none() && cfg.bounce_populate && host_landing == Landing::Bounce,
            fragments: dev.fragments,
            misbound,
            label: crate::send::label(dev, peer),
        });
        let comm = RecvComm {
            shared: shared.clone(),
            handle,
            has_devcomm,
            state: Mutex::new(RecvState {
                tail: 0,
                activated: 0,
                matched: 0,
                done: 0,
                head: 0,
                chunk_counter: 0,
                reqs: [RecvReq {
                    status: Status::Free,
                    posted: 0,
                    size: 0,
                    dst: std::ptr::null_mut(),
                    landing: Landing::Direct,
                }; MAX_REQUESTS],
            }),
            threads: Mutex::new(Vec::with_capacity(n + 1)),
            eager: cfg.progress == Progress::Eager,
        };
        let spawned = (|| -> io::Result<()> {
            let mut threads = lock(&comm.threads);
            let sh = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("tcpxemu-rctl".into())
                    .spawn(move || ctrl_reader(&sh))?,
            );
            let mut stagings = stagings.drain(..);
            for me in 0..n {
                let sh = shared.clone();
                let rng = rng::derive(cfg.seed, salt.wrapping_mul(131).wrapping_add(me as u64 + 1));
                let staging = stagings.next();
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("tcpxemu-rx{me}"))
                        .spawn(move || data_thread(&sh, me, rng, staging))?,
                );
            }
            Ok(())
        })();
        if let Err(e) = spawned {
            comm.close();
            return Err(e);
        }
        info!(
            "tcpxemu: recv comm ready ({}, {} data socket(s), host-memory receives {}, ring {:p} \
             (device view {:p}), bounce {:p} in {} memory{})",
            shared.label,
            n,
            match shared.host_landing {
                Landing::Bounce => "bounce",
                Landing::Direct => "direct",
            },
            shared.ring.meta(),
            shared.ring.meta_device(),
            shared.pool.base(),
            if shared.pool.is_device() { "device" } else { "host" },
            match cuda {
                Some(c) => format!(", CUDA device {} context {:#x}", c.device(), c.raw()),
                None => String::new(),
            }
        );
        Ok(comm)
    }

    pub(crate) fn label(&self) -> &str {
        &self.shared.label
    }

    /// The `unpackNetDeviceHandle` the device handle points at.
    pub(crate) fn unpack_handle(&self) -> *mut abi::unpackNetDeviceHandle {
        self.handle.ptr()
    }

    /// Post a receive of `size` bytes at `dst` (CUDA memory when `cuda_mem`); returns its slot
    /// (= its ring index q).
    pub(crate) fn irecv(&self, dst: *mut u8, size: u32, cuda_mem: bool) -> Result<usize, ncclResult_t> {
        let sh = &*self.shared;
        if let Some((code, msg)) = sh.health.failure() {
            warn!("{msg}");
            return Err(code);
        }
        let landing = if cuda_mem {
            if !sh.pool.is_device() {
                warn!(
                    "tcpxemu: irecv into CUDA memory on a comm without a device bounce buffer ({})",
                    sh.label
                );
                return Err(abi::NCCL_INTERNAL_ERROR);
            }
            Landing::Bounce
        } else {
            sh.host_landing
        };
        if landing == Landing::Bounce && !self.has_devcomm {
            warn!(
                "tcpxemu: irecv on a comm whose accept got no device-handle storage (recvDevComm \
                 was NULL): the fragment list cannot be published; the real plugin crashes on the \
                 first CUDA receive here ({})",
                sh.label
            );
            return Err(abi::NCCL_INTERNAL_ERROR);
        }
        let mut st = lock(&self.state);
        if st.tail - st.head >= MAX_REQUESTS as u64 {
            warn!(
                "tcpxemu: unable to allocate requests ({}: {} receives not yet consumed)",
                sh.label, MAX_REQUESTS
            );
            return Err(abi::NCCL_INTERNAL_ERROR);
        }
        let q = (st.tail % MAX_REQUESTS as u64) as usize;
        sh.ring.reset_cnt(q);
        sh.slots[q].bytes.store(0, Ordering::Relaxed);
        sh.slots[q].frags.store(0, Ordering::Relaxed);
        sh.slots[q].nblocks.store(0, Ordering::Relaxed);
        st.reqs[q] = RecvReq {
            status: Status::Posted,
            posted: size,
            size: 0,
            dst,
            landing,
        };
        st.tail += 1;
        if landing == Landing::Direct {
            info!(
                "tcpxemu: requested receive on host mem buffer ({} bytes, {})",
                size, sh.label
            );
        }
        trace!(
            "tcpxemu: irecv seq {} size {} q {} ({})",
            st.tail - 1,
            size,
            q,
            sh.label
        );
        Ok(q)
    }

    /// One progress call (`tcpxCommProgress`, src/net_tcpx.cc 1099–1307): activate the oldest
    /// posted receive (1158–1180), then match the oldest active one to its header, if it has
    /// come, and queue its chunk tasks (1227–1304). Eager: every posted receive, every header.
    fn match_headers(&self, st: &mut RecvState) -> Result<(), ncclResult_t> {
        let sh = &*self.shared;
        if st.activated < st.tail {
            st.activated = if self.eager { st.tail } else { st.activated + 1 };
        }
        let mut headers = lock(&sh.headers);
        while st.matched < st.activated {
            let Some(h) = headers.pop_front() else { break };
            if h.seq != st.matched {
                sh.health.fail(
                    abi::NCCL_INTERNAL_ERROR,
                    format!(
                        "tcpxemu: protocol error: control header seq {} where {} was expected ({})",
                        h.seq, st.matched, sh.label
                    ),
                );
                return Err(abi::NCCL_INTERNAL_ERROR);
            }
            let q = (st.matched % MAX_REQUESTS as u64) as usize;
            let r = &mut st.reqs[q];
            if h.size > r.posted {
                warn!(
                    "tcpxemu: receiver adopting sender's size {} > posted {} ({})",
                    h.size, r.posted, sh.label
                );
            }
            r.size = h.size;
            let (posted, dst, landing) = (r.posted, r.dst, r.landing);
            let n = wire::nchunks(h.size, h.chunk);
            let nsocks = sh.queues.len();
            for (me, tq) in sh.queues.iter().enumerate() {
                if wire::first_chunk_for(st.chunk_counter, me, nsocks) < n {
                    tq.push(RecvTask {
                        q,
                        size: h.size,
                        posted,
                        chunk: h.chunk,
                        start: st.chunk_counter,
                        dst: DstPtr(dst),
                        landing,
                    });
                }
            }
            st.chunk_counter += n;
            st.matched += 1;
            if !self.eager {
                break;
            }
        }
        Ok(())
    }

    /// Test receive slot `q`: `Ok(true)` when every byte is in place (`cnt[q]` published).
    pub(crate) fn test(&self, q: usize) -> Result<bool, ncclResult_t> {
        let sh = &*self.shared;
        let mut st = lock(&self.state);
        // Read EOF before draining: the reader queues every header before it flags EOF.
        let eof = sh.ctrl_eof.load(Ordering::Acquire);
        // The comm progresses first, as `tcpxTest` does, even when `q` is not the oldest.
        if !sh.health.stop() {
            self.match_headers(&mut st)?;
        }
        if !(st.done < st.tail
            && q == (st.done % MAX_REQUESTS as u64) as usize
            && st.reqs[q].status == Status::Posted)
        {
            warn!(
                "tcpxemu: test called with invalid request (recv slot {q}; the oldest in-flight is {}; {})",
                if st.done < st.tail {
                    ((st.done % MAX_REQUESTS as u64) as usize).to_string()
                } else {
                    "none".to_string()
                },
                sh.label
            );
            return Err(abi::NCCL_INTERNAL_ERROR);
        }
        let matched = st.matched > st.done;
        let r = st.reqs[q];
        if matched && sh.slots[q].bytes.load(Ordering::Acquire) >= u64::from(r.size) {
            let frags = sh.slots[q].frags.load(Ordering::Acquire);
            if r.landing == Landing::Bounce {
                sh.ring.publish_cnt(q, u64::from(frags));
            }
            st.reqs[q].status = Status::Done;
            st.done += 1;
            trace!(
                "tcpxemu: recv seq {} done ({} bytes, {} fragments, q {}, {})",
                st.done - 1,
                r.size,
                frags,
                q,
                sh.label
            );
            return Ok(true);
        }
        if let Some((code, msg)) = sh.health.failure() {
            warn!("tcpxemu: test: {msg}");
            return Err(code);
        }
        if !matched && eof {
            sh.peer_closed();
            return Err(abi::NCCL_SYSTEM_ERROR);
        }
        Ok(false)
    }

    /// Release a completed receive: recycle its pages, advance head, free the slot.
    pub(crate) fn consumed(&self, q: usize) -> Result<(), ncclResult_t> {
        let sh = &*self.shared;
        let mut st = lock(&self.state);
        if st.reqs[q].status != Status::Done {
            warn!(
                "tcpxemu: irecvConsumed called with invalid request (slot {q} is not a completed \
                 receive; {})",
                sh.label
            );
            return Err(abi::NCCL_INTERNAL_ERROR);
        }
        let head_q = (st.head % MAX_REQUESTS as u64) as usize;
        if head_q != q {
            warn!(
                "tcpxemu: unexpected q_idx {q} in irecvConsumed (ring head is {head_q}; {})",
                sh.label
            );
            return Err(abi::NCCL_INTERNAL_ERROR);
        }
        let slot = &sh.slots[q];
        let n = (slot.nblocks.load(Ordering::Acquire) as usize).min(NET_UNPACK_MAX_SLICE_PAGES);
        if n > 0 {
            sh.pool
                .give_back((0..n).map(|i| slot.blocks[i].load(Ordering::Relaxed)));
        }
        st.reqs[q].status = Status::Free;
        st.head += 1;
        Ok(())
    }

    /// `TCPXEMU_CLOSE=plugin`: waits, as the real plugin's close does, while a posted receive
    /// still expects bytes and the peer has not closed its end.
    fn wait_like_plugin(&self) {
        if crate::config::get().is_none_or(|c| c.close != CloseMode::Plugin) {
            return;
        }
        let sh = &*self.shared;
        let mut warned = false;
        loop {
            let waiting = {
                let st = lock(&self.state);
                (st.done..st.tail)
                    .filter(|&n| {
                        let q = (n % MAX_REQUESTS as u64) as usize;
                        st.reqs[q].status == Status::Posted
                            && sh.slots[q].bytes.load(Ordering::Acquire) < u64::from(st.reqs[q].size)
                    })
                    .count()
            };
            if waiting == 0 || sh.health.failure().is_some() || sh.ctrl_eof.load(Ordering::Acquire) {
                return;
            }
            if !warned {
                warn!(
                    "tcpxemu: closeRecv waits for {waiting} posted receive(s) still expecting bytes, or for the peer's close, as the real plugin's close does (TCPXEMU_CLOSE=plugin; {})",
                    sh.label
                );
                warned = true;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    pub(crate) fn close(&self) {
        self.wait_like_plugin();
        let sh = &*self.shared;
        sh.health.begin_close();
        for q in &sh.queues {
            q.wake();
        }
        sh.pool.wake_all();
        sh.shutdown_all();
        let threads: Vec<_> = lock(&self.threads).drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}
