//! Non-blocking connect: the first call starts a helper thread and parks a pointer to it in the
//! connect-stage bytes (88..128) of the caller's handle buffer; later calls with the same buffer
//! poll it.

use crate::sockio;
use crate::sync::lock;
use crate::wire::{
    self, ACK, HandleDesc, Hello, ROLE_CTRL, STAGE_CONNECTING, STAGE_IDLE, STAGE_PTR_OFF, STAGE_STATE_OFF,
};
use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a connector waits for the listener's `accept` to take its sockets.
const ACK_TIMEOUT: Duration = Duration::from_secs(120);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// The sockets of an established connection.
#[derive(Debug)]
pub(crate) struct Connected {
    pub(crate) ctrl: TcpStream,
    pub(crate) data: Vec<TcpStream>,
    pub(crate) peer: SocketAddr,
}

type Outcome = Option<Result<Connected, String>>;

struct Stage {
    result: Arc<Mutex<Outcome>>,
    thread: Option<JoinHandle<()>>,
}

/// Addresses of live stages: a stage pointer read from a handle is only trusted if listed.
static STAGES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

pub(crate) enum Poll {
    Pending,
    Ready(Connected),
    Failed(String),
    Invalid(String),
}

/// One `connect` call on the 128-byte handle buffer `h` (a local copy; the caller writes it back).
pub(crate) fn step(h: &mut [u8; 128], retry: u32) -> Poll {
    match h[STAGE_STATE_OFF] {
        STAGE_IDLE => start(h, retry),
        STAGE_CONNECTING => {
            let addr = wire::get_u64(h, STAGE_PTR_OFF) as usize;
            if !lock(&STAGES).contains(&addr) {
                return Poll::Invalid(
                    "the handle's connect stage does not name a connect in progress".into(),
                );
            }
            let p = addr as *mut Stage;
            // SAFETY: `addr` is listed in STAGES, so it is a live Box<Stage> made by `start` and
            // not yet freed (it is delisted before being freed, under the same lock discipline:
            // only connect calls on this handle buffer touch it).
            let stage = unsafe { &mut *p };
            let outcome = lock(&stage.result).take();
            let Some(outcome) = outcome else {
                return Poll::Pending;
            };
            lock(&STAGES).retain(|&a| a != addr);
            if let Some(t) = stage.thread.take() {
                let _ = t.join();
            }
            // SAFETY: delisted above; this is the only owner, created by Box::into_raw in `start`.
            drop(unsafe { Box::from_raw(p) });
            h[wire::HANDLE_DESC_LEN..].fill(0);
            match outcome {
                Ok(c) => Poll::Ready(c),
                Err(e) => Poll::Failed(e),
            }
        }
        s => Poll::Invalid(format!("the handle's connect stage has unknown state {s}")),
    }
}

fn start(h: &mut [u8; 128], retry: u32) -> Poll {
    let desc = match HandleDesc::decode(h) {
        Ok(d) => d,
        Err(e) => return Poll::Invalid(e),
    };
    let result: Arc<Mutex<Outcome>> = Arc::new(Mutex::new(None));
    let r2 = result.clone();
    let conn_id = crate::rng::entropy();
    let spawned = std::thread::Builder::new()
        .name("tcpxemu-connect".into())
        .spawn(move || {
            let out = run(&desc, retry, conn_id);
            *lock(&r2) = Some(out);
        });
    let thread = match spawned {
        Ok(t) => t,
        Err(e) => return Poll::Failed(format!("cannot start the connect helper thread: {e}")),
    };
    let p = Box::into_raw(Box::new(Stage {
        result,
        thread: Some(thread),
    }));
    lock(&STAGES).push(p as usize);
    h[STAGE_STATE_OFF] = STAGE_CONNECTING;
    h[STAGE_PTR_OFF..STAGE_PTR_OFF + 8].copy_from_slice(&(p as u64).to_le_bytes());
    Poll::Pending
}

fn connect_retry(addr: SocketAddr, retry: u32) -> Result<TcpStream, String> {
    let mut attempt = 0u32;
    loop {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && attempt < retry => {
                attempt += 1;
                std::thread::sleep(RETRY_PAUSE);
            }
            Err(e) => {
                return Err(format!(
                    "tcpxemu: connect to {addr} failed after {} attempt(s): {e}",
                    attempt + 1
                ));
            }
        }
    }
}

fn run(desc: &HandleDesc, retry: u32, conn_id: u64) -> Result<Connected, String> {
    let addr = SocketAddr::new(desc.addr, desc.port);
    let n = desc.sockets();
    let hello = |role: u16| {
        Hello {
            role,
            conn_id,
            nonce: desc.nonce,
            nsockets: n as u16,
        }
        .encode()
    };
    let send_hello = |s: &TcpStream, role: u16| {
        let b = hello(role);
        sockio::send_all(s.as_raw_fd(), b.as_ptr(), b.len())
            .map_err(|e| format!("tcpxemu: sending the hello to {addr} failed: {e}"))
    };
    let mut ctrl = connect_retry(addr, retry)?;
    send_hello(&ctrl, ROLE_CTRL)?;
    let mut data = Vec::with_capacity(n);
    for i in 0..n {
        let s = connect_retry(addr, retry)?;
        send_hello(&s, 1 + i as u16)?;
        data.push(s);
    }
    let deadline = Instant::now() + ACK_TIMEOUT;
    loop {
        if Instant::now() >= deadline {
            return Err(format!(
                "tcpxemu: connect to {addr}: the listener did not accept within {}s",
                ACK_TIMEOUT.as_secs()
            ));
        }
        match sockio::wait_readable(ctrl.as_raw_fd(), 100) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => return Err(format!("tcpxemu: connect to {addr}: poll failed: {e}")),
        }
        let mut b = [0u8; 1];
        return match ctrl.read(&mut b) {
            Ok(1) if b[0] == ACK => Ok(Connected {
                ctrl,
                data,
                peer: addr,
            }),
            Ok(1) => Err(format!(
                "tcpxemu: connect to {addr}: bad handshake byte {:#x}",
                b[0]
            )),
            Ok(_) => Err(format!(
                "tcpxemu: connect to {addr}: the listener closed the connection before accepting it"
            )),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => Err(format!("tcpxemu: connect to {addr}: handshake failed: {e}")),
        };
    }
}
