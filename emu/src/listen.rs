//! The listen comm: an acceptor thread collects sockets into complete groups (ctrl + every data
//! socket of one connection id); `accept` hands out one group per completed accept.

use crate::config::{Config, Device};
use crate::sockio;
use crate::sync::lock;
use crate::wire::{ACK, HELLO_LEN, HandleDesc, Hello, ROLE_CTRL};
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const HELLO_TIMEOUT: Duration = Duration::from_secs(3);
const STALE_GROUP: Duration = Duration::from_secs(60);

/// A complete connection: its ctrl socket and its data sockets in index order.
#[derive(Debug)]
pub(crate) struct Group {
    pub(crate) ctrl: TcpStream,
    pub(crate) data: Vec<TcpStream>,
    pub(crate) peer: SocketAddr,
    pub(crate) complete_at: Instant,
}

struct Partial {
    ctrl: Option<TcpStream>,
    data: Vec<Option<TcpStream>>,
    peer: SocketAddr,
    since: Instant,
}

struct ListenShared {
    stop: AtomicBool,
    ready: Mutex<VecDeque<Group>>,
}

pub(crate) struct ListenComm {
    pub(crate) dev: &'static Device,
    shared: Arc<ListenShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// `Some(start)` while an accept is in progress.
    accepting: Mutex<Option<Instant>>,
}

pub(crate) enum AcceptPoll {
    Pending,
    Ready(Group),
}

impl ListenComm {
    pub(crate) fn new(dev: &'static Device, cfg: &Config) -> io::Result<(ListenComm, HandleDesc)> {
        let listener = TcpListener::bind(SocketAddr::new(dev.addr, 0))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let desc = HandleDesc {
            device: dev.index as u32,
            addr: dev.addr,
            port,
            nsocks: cfg.nsocks as u16,
            nthreads: cfg.nthreads as u16,
            nonce: crate::rng::entropy(),
        };
        let shared = Arc::new(ListenShared {
            stop: AtomicBool::new(false),
            ready: Mutex::new(VecDeque::new()),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("tcpxemu-accept".into())
            .spawn(move || acceptor(&listener, &sh, desc))?;
        info!(
            "tcpxemu: listening on {} port {} (dev{} {}, {} data socket(s) per comm)",
            dev.addr,
            port,
            dev.index,
            dev.ifname.to_string_lossy(),
            desc.sockets()
        );
        Ok((
            ListenComm {
                dev,
                shared,
                thread: Mutex::new(Some(thread)),
                accepting: Mutex::new(None),
            },
            desc,
        ))
    }

    /// One `accept` call.
    pub(crate) fn accept_step(&self, flow_wait: Duration) -> AcceptPoll {
        let mut acc = lock(&self.accepting);
        let Some(since) = *acc else {
            *acc = Some(Instant::now());
            return AcceptPoll::Pending;
        };
        loop {
            let mut ready = lock(&self.shared.ready);
            let Some(front) = ready.front() else {
                return AcceptPoll::Pending;
            };
            if Instant::now() < front.complete_at.max(since) + flow_wait {
                return AcceptPoll::Pending;
            }
            let Some(g) = ready.pop_front() else {
                return AcceptPoll::Pending;
            };
            drop(ready);
            if let Err(e) = sockio::send_all(g.ctrl.as_raw_fd(), &ACK, 1) {
                warn!(
                    "tcpxemu: dropping a connection from {} whose connector went away: {e}",
                    g.peer
                );
                continue;
            }
            *acc = None;
            return AcceptPoll::Ready(g);
        }
    }

    pub(crate) fn close(&self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
        lock(&self.shared.ready).clear();
    }
}

fn acceptor(listener: &TcpListener, sh: &ListenShared, desc: HandleDesc) {
    let mut partial: HashMap<u64, Partial> = HashMap::new();
    let n = desc.sockets();
    while !sh.stop.load(Ordering::Acquire) {
        match sockio::wait_readable(listener.as_raw_fd(), 50) {
            Ok(true) => {}
            Ok(false) => {}
            Err(e) => {
                warn!("tcpxemu: poll on the listening socket failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        loop {
            match listener.accept() {
                Ok((s, peer)) => take_socket(s, peer, sh, &desc, n, &mut partial),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    warn!("tcpxemu: accept on port {} failed: {e}", desc.port);
                    break;
                }
            }
        }
        let now = Instant::now();
        partial.retain(|id, p| {
            let keep = now.duration_since(p.since) < STALE_GROUP;
            if !keep {
                warn!(
                    "tcpxemu: dropping incomplete connection {id:#x} from {} (sockets missing after {}s)",
                    p.peer,
                    STALE_GROUP.as_secs()
                );
            }
            keep
        });
    }
}

fn read_hello(s: &mut TcpStream, sh: &ListenShared) -> Result<Hello, String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + HELLO_TIMEOUT;
    let mut b = [0u8; HELLO_LEN];
    let mut got = 0;
    while got < HELLO_LEN {
        if sh.stop.load(Ordering::Acquire) {
            return Err("listener closing".into());
        }
        if Instant::now() >= deadline {
            return Err(format!("no hello within {}s", HELLO_TIMEOUT.as_secs()));
        }
        match s.read(&mut b[got..]) {
            Ok(0) => return Err("closed before its hello".into()),
            Ok(k) => got += k,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    Hello::decode(&b)
}

fn take_socket(
    mut s: TcpStream,
    peer: SocketAddr,
    sh: &ListenShared,
    desc: &HandleDesc,
    n: usize,
    partial: &mut HashMap<u64, Partial>,
) {
    let hello = match read_hello(&mut s, sh) {
        Ok(h) => h,
        Err(why) => {
            if !sh.stop.load(Ordering::Acquire) {
                warn!(
                    "tcpxemu: dropping a connection from {peer} on port {}: {why}",
                    desc.port
                );
            }
            return;
        }
    };
    if hello.nonce != desc.nonce || usize::from(hello.nsockets) != n || usize::from(hello.role) > n {
        warn!(
            "tcpxemu: dropping a connection from {peer} on port {}: hello for another listener \
             or socket count (nonce {:#x}, {} sockets, role {})",
            desc.port, hello.nonce, hello.nsockets, hello.role
        );
        return;
    }
    let _ = s.set_nodelay(true);
    let p = partial.entry(hello.conn_id).or_insert_with(|| Partial {
        ctrl: None,
        data: (0..n).map(|_| None).collect(),
        peer,
        since: Instant::now(),
    });
    let slot = if hello.role == ROLE_CTRL {
        &mut p.ctrl
    } else {
        &mut p.data[usize::from(hello.role) - 1]
    };
    if slot.is_some() {
        warn!(
            "tcpxemu: dropping a duplicate socket (role {}) of connection {:#x} from {peer}",
            hello.role, hello.conn_id
        );
        return;
    }
    *slot = Some(s);
    if p.ctrl.is_some() && p.data.iter().all(Option::is_some) {
        if let Some(p) = partial.remove(&hello.conn_id) {
            let Partial { ctrl, data, peer, .. } = p;
            if let Some(ctrl) = ctrl {
                lock(&sh.ready).push_back(Group {
                    ctrl,
                    data: data.into_iter().flatten().collect(),
                    peer,
                    complete_at: Instant::now(),
                });
            }
        }
    }
}
