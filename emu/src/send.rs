//! The send comm: requests are recorded by `isend` and dispatched only inside `test`; one
//! helper thread per data socket writes its share of the chunks; a ctrl watcher notices the
//! peer going away. In CUDA mode each writer owns pinned staging and a stream, through which
//! it reads sends from CUDA memory (device → pinned → socket).

use crate::abi::{self, MAX_REQUESTS, ncclResult_t};
use crate::config::{CloseMode, Device};
use crate::connect::Connected;
use crate::cuda::Ctx;
use crate::memory::{SendStaging, StageError};
use crate::sockio;
use crate::sync::{Health, TaskQueue, lock};
use crate::wire::{self, Header};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

#[derive(Debug)]
struct SendTask {
    slot: usize,
    data: SrcPtr,
    size: u32,
    chunk: u32,
    start: u64,
    /// The source is CUDA memory (staged through pinned memory).
    cuda: bool,
}

struct SendShared {
    health: Health,
    ctrl: TcpStream,
    data: Vec<TcpStream>,
    queues: Vec<TaskQueue<SendTask>>,
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

struct SendState {
    posted: u64,
    dispatched: u64,
    freed: u64,
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
                dispatched: 0,
                freed: 0,
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

    /// Send every recorded request whose delay has elapsed, in order.
    fn dispatch(&self, st: &mut SendState) {
        let sh = &*self.shared;
        let now = Instant::now();
        while st.dispatched < st.posted && !sh.health.stop() {
            let slot = (st.dispatched % MAX_REQUESTS as u64) as usize;
            let r = st.reqs[slot];
            if r.size > 0 && self.chunk == 0 {
                // The real plugin's default chunk size: nothing ever goes out.
                break;
            }
            if now < r.posted_at + sh.dev.delay {
                break;
            }
            if sh.peer_gone.load(Ordering::Acquire) {
                sh.peer_closed();
                return;
            }
            let h = Header {
                chunk: self.chunk,
                seq: st.dispatched,
                size: r.size,
            }
            .encode();
            if let Err(e) = sockio::send_all(sh.ctrl.as_raw_fd(), h.as_ptr(), h.len()) {
                sh.socket_error("control header", &e);
                return;
            }
            let n = wire::nchunks(r.size, self.chunk);
            let nsocks = sh.queues.len();
            for (me, q) in sh.queues.iter().enumerate() {
                if wire::first_chunk_for(st.chunk_counter, me, nsocks) < n {
                    q.push(SendTask {
                        slot,
                        data: SrcPtr(r.data),
                        size: r.size,
                        chunk: self.chunk,
                        start: st.chunk_counter,
                        cuda: r.cuda,
                    });
                }
            }
            st.chunk_counter += n;
            st.dispatched += 1;
        }
    }

    /// Test `slot`: `Ok(true)` when done (the slot is freed).
    pub(crate) fn test(&self, slot: usize) -> Result<bool, ncclResult_t> {
        let sh = &*self.shared;
        let mut st = lock(&self.state);
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
        self.dispatch(&mut st);
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

    /// `TCPXEMU_CLOSE=plugin`: waits, as the real plugin's close does, while a posted send has
    /// bytes left to write and the peer has not closed its end.
    fn wait_like_plugin(&self) {
        if crate::config::get().is_none_or(|c| c.close != CloseMode::Plugin) {
            return;
        }
        let sh = &*self.shared;
        let mut warned = false;
        loop {
            let waiting = {
                let st = lock(&self.state);
                (st.freed..st.posted)
                    .filter(|&n| {
                        let q = (n % MAX_REQUESTS as u64) as usize;
                        sh.written[q].load(Ordering::Acquire) < u64::from(st.reqs[q].size)
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
    let nsocks = sh.queues.len() as u64;
    let hold = crate::config::get().and_then(|c| c.hold.as_ref());
    while let Some(t) = sh.queues[me].pop(&sh.health) {
        let total = wire::nchunks(t.size, t.chunk);
        let mut k = wire::first_chunk_for(t.start, me, nsocks as usize);
        while k < total {
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
            k += nsocks;
        }
    }
}
