//! The framed session's request side (`FramedRequests`): the client's one order across the
//! request ring and the socket, with the client's writes injected between the daemon's look at
//! the ring and its read of the socket (the window CI hit once in session 31).

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream as StdStream;
use std::sync::atomic::{Ordering, fence};
use std::sync::{Arc, Mutex};

use prost::Message;
use rustix::fs::{MemfdFlags, SealFlags};
use tokio_util::codec::FramedRead;

use super::fds::{FdReader, Positioned};
use super::ring::{HEADER_WORDS, Ring, SLOT_HEAD};
use super::session::{Incoming, Requests};
use super::{FramedRequests, pb};
use crate::api::proto::v1::session_request::Op;
use crate::host_file::Unsealed;
use crate::net::shared_words::SharedWords;

const SLOTS: u64 = 16;
const SLOT_BYTES: u64 = 256;

/// The client's side: its socket and its view of the ring.
struct Client {
    sock: StdStream,
    view: SharedWords,
    written: u64,
    /// Socket frames sent after the attach (none here: the ring is attached directly).
    sent: u64,
}

impl Client {
    /// Writes `req` as the next ring entry (`socket_before`: the frames sent so far), then the
    /// full fence the client puts before reading `spinning`.
    fn ring(&mut self, req: &pb::SessionRequest) {
        let k = self.written + 1;
        let at = HEADER_WORDS + ((k - 1) % SLOTS) as usize * (SLOT_BYTES / 8) as usize;
        let bytes = req.encode_to_vec();
        self.view.store(at + 1, bytes.len() as u64, Ordering::Relaxed);
        self.view.store(at + 2, self.sent, Ordering::Relaxed);
        for (i, c) in bytes.chunks(8).enumerate() {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            self.view
                .store(at + SLOT_HEAD / 8 + i, u64::from_le_bytes(b), Ordering::Relaxed);
        }
        self.view.store(at, k, Ordering::Release);
        self.written = k;
        fence(Ordering::SeqCst);
    }

    /// Sends `req` as a socket frame.
    fn socket(&mut self, req: &pb::SessionRequest) {
        let body = req.encode_to_vec();
        let mut frame = (body.len() as u32).to_be_bytes().to_vec();
        frame.extend(body);
        (&self.sock).write_all(&frame).unwrap();
        self.sent += 1;
    }
}

fn request(tag: u64, op: Op) -> pb::SessionRequest {
    pb::SessionRequest { tag, op: Some(op) }
}

/// A session's request side reading `server`, a ring attached; the client's side of both.
fn session() -> (FramedRequests, Arc<Mutex<Client>>) {
    let (client, server) = StdStream::pair().unwrap();
    let fd: OwnedFd =
        rustix::fs::memfd_create("requests-test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    let bytes = 64 + SLOTS * SLOT_BYTES;
    rustix::fs::ftruncate(&fd, bytes).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK).unwrap();
    let ring = Ring::attach(&fd, SLOTS as u32, SLOT_BYTES as u32).unwrap();
    let view = SharedWords::map(fd.as_fd(), bytes as usize / 8).unwrap();
    let mut requests = FramedRequests {
        frames: FramedRead::new(FdReader::new(server).unwrap(), Positioned::default()),
        unsealed: Unsealed::Refused,
        peer_pid: None,
        off_poller: None,
        watch: None,
        rings: Arc::new(crate::poller::RingWatch::default()),
        ring: None,
        from_ring: None,
        held: None,
        unread: false,
        before_read: None,
    };
    requests.attach_ring(ring).unwrap();
    let client = Client {
        sock: client,
        view,
        written: 0,
        sent: 0,
    };
    (requests, Arc::new(Mutex::new(client)))
}

/// The tags (0 for a doorbell) and ends the request side hands out, `n` of them.
async fn next_n(requests: &mut FramedRequests, n: usize) -> Vec<String> {
    let mut got = Vec::new();
    for _ in 0..n {
        got.push(match requests.next().await {
            Incoming::Request(r) => format!("tag {}", r.tag),
            Incoming::HalfClosed => "half-closed".into(),
            Incoming::Gone => "gone".into(),
            Incoming::Broken(s) => format!("broken: {}", s.message()),
        });
    }
    got
}

/// Runs `write` once, right before the request side's next read of the socket (after its look
/// at the ring found nothing).
fn before_next_read(requests: &mut FramedRequests, write: impl FnOnce() + Send + 'static) {
    let mut once = Some(write);
    requests.before_read = Some(Box::new(move || {
        if let Some(w) = once.take() {
            w();
        }
    }));
}

/// A WRITE on the ring, then its cancel on the socket, both written between the daemon's look at
/// the ring and its read of the socket: the WRITE is handed out first; and so in the other
/// direction (the frame first, then an entry after it), and with the socket's end after an
/// entry (the entry, then the end: not "an entry after frames that never came").
#[tokio::test]
async fn a_ring_entry_written_just_before_a_socket_frame_is_handed_out_first() {
    let (mut requests, client) = session();
    // A frame first: the reader then knows its socket readable, and its next poll reads it.
    client.lock().unwrap().socket(&request(1, Op::CancelTag(1)));
    assert_eq!(next_n(&mut requests, 1).await, ["tag 1"]);
    let c = client.clone();
    before_next_read(&mut requests, move || {
        let mut c = c.lock().unwrap();
        c.ring(&request(7, Op::CancelTag(1)));
        c.socket(&request(8, Op::CancelTag(7)));
    });
    assert_eq!(next_n(&mut requests, 2).await, ["tag 7", "tag 8"]);
    assert!(requests.held.is_none());
    // The other way: a frame, then an entry that says it came after it.
    let c = client.clone();
    before_next_read(&mut requests, move || {
        let mut c = c.lock().unwrap();
        c.socket(&request(9, Op::CancelTag(1)));
        c.ring(&request(10, Op::CancelTag(9)));
    });
    assert_eq!(next_n(&mut requests, 2).await, ["tag 9", "tag 10"]);
    // Two entries before a frame, all in the window.
    let c = client.clone();
    before_next_read(&mut requests, move || {
        let mut c = c.lock().unwrap();
        c.ring(&request(11, Op::CancelTag(1)));
        c.ring(&request(12, Op::CancelTag(1)));
        c.socket(&request(13, Op::CancelTag(12)));
        c.ring(&request(14, Op::CancelTag(13)));
    });
    assert_eq!(
        next_n(&mut requests, 4).await,
        ["tag 11", "tag 12", "tag 13", "tag 14"]
    );
    // An entry, then the client's half-close.
    let c = client.clone();
    before_next_read(&mut requests, move || {
        let mut c = c.lock().unwrap();
        c.ring(&request(15, Op::CancelTag(1)));
        c.sock.shutdown(std::net::Shutdown::Write).unwrap();
    });
    assert_eq!(next_n(&mut requests, 2).await, ["tag 15", "half-closed"]);
}
