//! The send comm: requests are recorded by `isend` and move only inside `test`, as in Google's
//! plugin (`tcpxIsend_v5` queues, `tcpxTest` runs `tcpxCommProgress`): each call activates at
//! most one posted request and hands the oldest active one's chunks to the data sockets, at most
//! one chunk per socket with room (`TCPXEMU_PROGRESS=eager`: every request, whole, at once). One
//! helper thread per data socket writes the chunks handed to it; a ctrl watcher notices the
//! peer going away. In CUDA mode each writer owns pinned staging and a stream, through which
//! it reads sends from CUDA memory (device → pinned → socket).

use crate::abi::{self, MAX_REQUESTS, ncclResult_t};
use crate::config::{CloseMode, Device, MAX_TASKS, Progress};
use crate::connect::Connected;
use crate::cuda::Ctx;
use crate::memory::{SendStaging, StageError};
use crate::sockio;
use crate::sync::{Health, TaskQueue, lock};
use crate::wire::{self, Header};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// The caller's buffer, read by a socket thread until the request is done (or the comm closes
/// and joins its threads).
#[derive(Debug, Clone, Copy)]
struct SrcPtr(*const u8);
// SAFETY: NCCL's contract keeps the buffer alive and unmodified until test reports the send
// done; closeSend joins every socket thread before returning.
unsafe impl Send for SrcPtr {}

/// One chunk of a request, handed to the socket that carries it.
#[derive(Debug)]
struct SendTask {
    slot: usize,
    data: SrcPtr,
    size: u32,
    chunk: u32,
    /// The chunk's index within the request.
    k: u64,
    /// The source is CUDA memory (staged through pinned memory).
    cuda: bool,
}

struct SendShared {
    health: Health,
    ctrl: TcpStream,
    data: Vec<TcpStream>,
    queues: Vec<TaskQueue<SendTask>>,
    /// Chunks handed to each socket and not yet written (at most `MAX_TASKS` when faithful).
    pending: Vec<AtomicU32>,
    written: [AtomicU64; MAX_REQUESTS],
    sent: AtomicU64,
    peer_gone: AtomicBool,
    dev: &'static Device,
    label: String,
}

impl SendShared {
    fn shutdown_all(&self) {
        let _ = self.ctrl.shutdown(Shutdown::Both);
        for s in &self.data {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn socket_error(&self, what: &str, e: &io::Error) {
        if self.health.closing() {
            return;
        }
        if sockio::is_peer_closed(e) || self.peer_gone.load(Ordering::Acquire) {
            self.health.fail(
                abi::NCCL_SYSTEM_ERROR,
                format!(
                    "tcpxemu: Connection closed by remote peer ({}, {what}: {e})",
                    self.label
                ),
            );
        } else {
            self.health.fail(
                abi::NCCL_SYSTEM_ERROR,
                format!("tcpxemu: {} {what} failed: {e}", self.label),
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

#[derive(Debug, Clone, Copy)]
struct SendReq {
    data: *const u8,
    size: u32,
    cuda: bool,
    posted_at: Instant,
}

/// Request counters, each ≤ the one before: `posted` (isend), `activated` (a test took it
/// from posted), `dispatched` (every chunk handed to a socket), `freed` (tested done). The
/// request `dispatched` is the oldest active one: `handed` of its chunks are handed, its header
/// is sent once `started`.
struct SendState {
    posted: u64,
    activated: u64,
    dispatched: u64,
    freed: u64,
    handed: u64,
    started: bool,
    chunk_counter: u64,
    reqs: [SendReq; MAX_REQUESTS],
}

pub(crate) struct SendComm {
    shared: Arc<SendShared>,
    state: Mutex<SendState>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    chunk: u32,
    /// CUDA mode: sends from CUDA memory are possible.
    cuda: bool,
    /// `TCPXEMU_PROGRESS=eager`: a test moves everything posted.
    eager: bool,
}

impl SendComm {
    pub(crate) fn new(
        conn: Connected,
        dev: &'static Device,
        chunk: u32,
        cuda: Option<&Arc<Ctx>>,
    ) -> io::Result<SendComm> {
        let Connected { ctrl, data, peer } = conn;
        let n = data.len();
        let stagings = match cuda {
            None => Vec::new(),
            Some(ctx) => (0..n)
                .map(|_| SendStaging::new(ctx))
                .collect::<io::Result<Vec<_>>>()?,
        };
        let shared = Arc::new(SendShared {
            health: Health::default(),
            ctrl,
            data,
            queues: (0..n).map(|_| TaskQueue::new()).collect(),
            pending: (0..n).map(|_| AtomicU32::new(0)).collect(),
            written: std::array::from_fn(|_| AtomicU64::new(0)),
            sent: AtomicU64::new(0),
            peer_gone: AtomicBool::new(false),
            dev,
            label: label(dev, peer),
        });
        let comm = SendComm {
            shared: shared.clone(),
            state: Mutex::new(SendState {
                posted: 0,
                activated: 0,
                dispatched: 0,
                freed: 0,
                handed: 0,
                started: false,
                chunk_counter: 0,
                reqs: [SendReq {
                    data: std::ptr::null(),
                    size: 0,
                    cuda: false,
                    posted_at: Instant::now(),
                }; MAX_REQUESTS],
            }),
            threads: Mutex::new(Vec::with_capacity(n + 1)),
            chunk,
            cuda: cuda.is_some(),
            eager: crate::config::get().is_some_and(|c| c.progress == Progress::Eager),
        };
        let spawned = (|| -> io::Result<()> {
            let mut threads = lock(&comm.threads);
            let sh = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("tcpxemu-sctl".into())
                    .spawn(move || ctrl_watcher(&sh))?,
            );
            let mut stagings = stagings.into_iter();
            for me in 0..n {
                let sh = shared.clone();
                let staging = stagings.next();
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("tcpxemu-tx{me}"))
                        .spawn(move || data_thread(&sh, me, staging))?,
                );
            }
            Ok(())
        })();
        if let Err(e) = spawned {
            comm.close();
            return Err(e);
        }
        info!(
            "tcpxemu: send comm ready ({}, {} data socket(s){})",
            shared.label,
            n,
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

    /// Record a send (from CUDA memory when `cuda_mem`); returns its slot.
    pub(crate) fn isend(&self, data: *const u8, size: u32, cuda_mem: bool) -> Result<usize, ncclResult_t> {
        if let Some((code, msg)) = self.shared.health.failure() {
            warn!("{msg}");
            return Err(code);
        }
        if cuda_mem && !self.cuda {
            warn!(
                "tcpxemu: isend from CUDA memory on a comm without CUDA staging ({})",
                self.shared.label
            );
            return Err(abi::NCCL_INTERNAL_ERROR);
        }
        let mut st = lock(&self.state);
        if st.posted - st.freed >= MAX_REQUESTS as u64 {
            warn!(
                "tcpxemu: unable to allocate requests ({}: {} sends outstanding)",
                self.shared.label, MAX_REQUESTS
            );
            return Err(abi::NCCL_INTERNAL_ERROR);
        }
        let slot = (st.posted % MAX_REQUESTS as u64) as usize;
        st.reqs[slot] = SendReq {
            data,
            size,
            cuda: cuda_mem,
            posted_at: Instant::now(),
        };
        self.shared.written[slot].store(0, Ordering::Relaxed);
        st.posted += 1;
        trace!(
            "tcpxemu: isend seq {} size {} slot {} ({})",
            st.posted - 1,
            size,
            slot,
            self.shared.label
        );
        Ok(slot)
    }

    /// One progress call (`tcpxCommProgress`, src/net_tcpx.cc 1099–1307): activate the oldest
    /// posted request whose delay has elapsed (1158–1180), then hand the oldest active one's
    /// chunks to the sockets, one per socket with room (1182–1226). Eager: every posted
    /// request, every chunk.
    fn progress(&self, st: &mut SendState) {
        let sh = &*self.shared;
        let now = Instant::now();
        while st.activated < st.posted {
            let r = st.reqs[(st.activated % MAX_REQUESTS as u64) as usize];
            if (r.size > 0 && self.chunk == 0) || now < r.posted_at + sh.dev.delay {
                // A zero chunk size (the real plugin's default): nothing ever goes out; a
                // device delay (`DELAY_US`) holds the request and every later one.
                break;
            }
            st.activated += 1;
            if !self.eager {
                break;
            }
        }
        while st.dispatched < st.activated && !sh.health.stop() {
            if !self.hand(st) || !self.eager {
                break;
            }
        }
    }

    /// Hands chunks of the oldest active request (its header first); true when all are.
    fn hand(&self, st: &mut SendState) -> bool {
        let sh = &*self.shared;
        let slot = (st.dispatched % MAX_REQUESTS as u64) as usize;
        let r = st.reqs[slot];
        if sh.peer_gone.load(Ordering::Acquire) {
            sh.peer_closed();
            return false;
        }
        if !st.started {
            let h = Header {
                chunk: self.chunk,
                seq: st.dispatched,
                size: r.size,
            }
            .encode();
            if let Err(e) = sockio::send_all(sh.ctrl.as_raw_fd(), h.as_ptr(), h.len()) {
                sh.socket_error("control header", &e);
                return false;
            }
            st.started = true;
        }
        let n = wire::nchunks(r.size, self.chunk);
        let nsocks = sh.queues.len() as u64;
        let mut this_call = 0;
        while st.handed < n {
            let me = ((st.chunk_counter + st.handed) % nsocks) as usize;
            if !self.eager && (this_call == nsocks || sh.pending[me].load(Ordering::Acquire) >= MAX_TASKS) {
                break;
            }
            sh.pending[me].fetch_add(1, Ordering::AcqRel);
            sh.queues[me].push(SendTask {
                slot,
                data: SrcPtr(r.data),
                size: r.size,
                chunk: self.chunk,
                k: st.handed,
                cuda: r.cuda,
            });
            st.handed += 1;
            this_call += 1;
        }
        if st.handed < n {
            return false;
        }
        st.chunk_counter += n;
        st.dispatched += 1;
        st.handed = 0;
        st.started = false;
        true
    }

    /// Test `slot`: `Ok(true)` when done (the slot is freed). The comm progresses first, as
    /// `tcpxTest` does, even when `slot` is not the oldest request.
    pub(crate) fn test(&self, slot: usize) -> Result<bool, ncclResult_t> {
        let sh = &*self.shared;
        let mut st = lock(&self.state);
        if !sh.health.stop() {
            self.progress(&mut st);
        }
        if !(st.freed < st.posted && slot == (st.freed % MAX_REQUESTS as u64) as usize) {
            warn!(
                "tcpxemu: test called with invalid request (send slot {slot}; the oldest in-flight is {}; {})",
                if st.freed < st.posted {
                    ((st.freed % MAX_REQUESTS as u64) as usize).to_string()
                } else {
                    "none".to_string()
                },
                sh.label
            );
            return Err(abi::NCCL_INTERNAL_ERROR);
        }
        let r = st.reqs[slot];
        if st.dispatched > st.freed && sh.written[slot].load(Ordering::Acquire) >= u64::from(r.size) {
            trace!(
                "tcpxemu: send seq {} done ({} bytes, {})",
                st.freed, r.size, sh.label
            );
            st.freed += 1;
            return Ok(true);
        }
        if let Some((code, msg)) = sh.health.failure() {
            warn!("tcpxemu: test: {msg}");
            return Err(code);
        }
        Ok(false)
    }

    /// `TCPXEMU_CLOSE=plugin`: waits, as the real plugin's close does, while chunks handed to the
    /// sockets have bytes left to write and the peer has not closed its end (a send never
    /// tested was never handed: its bytes never go).
    fn wait_like_plugin(&self) {
        if crate::config::get().is_none_or(|c| c.close != CloseMode::Plugin) {
            return;
        }
        let sh = &*self.shared;
        let mut warned = false;
        loop {
            let waiting = {
                let st = lock(&self.state);
                (st.freed..=st.dispatched.min(st.posted.saturating_sub(1)))
                    .filter(|&n| {
                        let q = (n % MAX_REQUESTS as u64) as usize;
                        let size = u64::from(st.reqs[q].size);
                        let handed = if n < st.dispatched {
                            size
                        } else {
                            (st.handed * u64::from(self.chunk)).min(size)
                        };
                        n < st.posted && sh.written[q].load(Ordering::Acquire) < handed
                    })
                    .count()
            };
            if waiting == 0 || sh.health.failure().is_some() || sh.peer_gone.load(Ordering::Acquire) {
                return;
            }
            if !warned {
                warn!(
                    "tcpxemu: closeSend waits for {waiting} posted send(s) with bytes left, or for the peer's close, as the real plugin's close does (TCPXEMU_CLOSE=plugin; {})",
                    sh.label
                );
                warned = true;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Stop the helpers (sockets shut down so blocked calls return) and join them.
    pub(crate) fn close(&self) {
        self.wait_like_plugin();
        let sh = &*self.shared;
        sh.health.begin_close();
        for q in &sh.queues {
            q.wake();
        }
        sh.shutdown_all();
        let threads: Vec<_> = lock(&self.threads).drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

pub(crate) fn label(dev: &Device, peer: SocketAddr) -> String {
    format!("dev{} {} <-> {}", dev.index, dev.ifname.to_string_lossy(), peer)
}

/// The receiver never writes on ctrl after the ack: EOF there means it went away.
fn ctrl_watcher(sh: &SendShared) {
    let mut b = [0u8; 64];
    loop {
        // SAFETY: `b` is a live local buffer of the given length.
        let n = unsafe { libc::recv(sh.ctrl.as_raw_fd(), b.as_mut_ptr().cast(), b.len(), 0) };
        if n > 0 {
            continue;
        }
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        if !sh.health.closing() {
            sh.peer_gone.store(true, Ordering::Release);
        }
        return;
    }
}

/// One data socket's writer. `staging` (CUDA mode) reads CUDA sources; the thread binds the
/// comm's context for its whole life.
fn data_thread(sh: &SendShared, me: usize, staging: Option<SendStaging>) {
    let _bound = match staging.as_ref().map(SendStaging::bind) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => {
            sh.health.fatal(
                abi::NCCL_UNHANDLED_CUDA_ERROR,
                format!(
                    "tcpxemu: cannot make the CUDA context current on a send thread: {e} ({})",
                    sh.label
                ),
            );
            return;
        }
    };
    let fd = sh.data[me].as_raw_fd();
    let hold = crate::config::get().and_then(|c| c.hold.as_ref());
    while let Some(t) = sh.queues[me].pop(&sh.health) {
        let k = t.k;
        if sh.health.stop() {
            return;
        }
        if sh.peer_gone.load(Ordering::Acquire) {
            sh.peer_closed();
            return;
        }
        let off = k * u64::from(t.chunk);
        let len = (u64::from(t.size) - off).min(u64::from(t.chunk));
        if let Some(gate) = hold {
            while !gate.try_admit(len) {
                if !sh.health.sleep_until(Instant::now() + crate::hold::POLL) {
                    return;
                }
            }
        }
        if let Some(end) = sh.dev.pacer.reserve(len) {
            if !sh.health.sleep_until(end) {
                return;
            }
        }
        let mut n = len;
        let mut trip = None;
        if let Some(limit) = sh.dev.fail_after {
            let prev = sh.sent.fetch_add(len, Ordering::AcqRel);
            if prev + len >= limit {
                n = limit.saturating_sub(prev).min(len);
                trip = Some(limit);
            }
        }
        if n > 0 && t.cuda {
            let Some(stage) = &staging else {
                sh.health.fail(
                    abi::NCCL_INTERNAL_ERROR,
                    format!(
                        "tcpxemu: internal error: a CUDA send without staging ({})",
                        sh.label
                    ),
                );
                return;
            };
            // off + n ≤ size, inside the caller's registered device range (checked by isend).
            let src = t.data.0 as u64 + off;
            let sent = stage.send_device(src, n as usize, |p, len| sockio::send_all(fd, p, len));
            match sent {
                Ok(()) => {}
                Err(StageError::Io(e)) => {
                    sh.socket_error("data write", &e);
                    return;
                }
                Err(StageError::Cuda(e)) => {
                    sh.health.fatal(
                        abi::NCCL_UNHANDLED_CUDA_ERROR,
                        format!(
                            "tcpxemu: copying a send from CUDA memory to pinned staging failed: {e} ({})",
                            sh.label
                        ),
                    );
                    return;
                }
            }
        } else if n > 0 {
            // SAFETY: off + n ≤ size, inside the caller's registered buffer (checked by isend).
            let p = unsafe { t.data.0.add(off as usize) };
            if let Err(e) = sockio::send_all(fd, p, n as usize) {
                sh.socket_error("data write", &e);
                return;
            }
        }
        if let Some(limit) = trip {
            sh.health.fail(
                abi::NCCL_SYSTEM_ERROR,
                format!(
                    "tcpxemu: injected connection failure after {limit} bytes ({})",
                    sh.label
                ),
            );
            sh.shutdown_all();
            return;
        }
        sh.written[t.slot].fetch_add(len, Ordering::Release);
        sh.pending[me].fetch_sub(1, Ordering::AcqRel);
    }
}
