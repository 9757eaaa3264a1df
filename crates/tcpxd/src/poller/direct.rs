//! A pairing's direct control connection as the poller drives it (docs/ARCHITECTURE.md, "The
//! direct control connection"): once switched, the poller frames each engine message itself
//! into the link's buffer and writes what a batch of actions framed with one non-blocking
//! `send` (no async worker, no HTTP/2), and keeps what the socket could not take yet to send in
//! a later pass; it reads the other way itself too: the socket is
//! in its epoll set (`park.rs`) from the moment the peer's `DirectSwitch` came on the control
//! stream (so nothing the peer sent later overtakes what it sent before), and each pass reads
//! what epoll reported readable and decodes the frames (a partial one kept per connection) into
//! the peer's messages, handled with the commands. One thread wake-up a message when the poller
//! is parked, none when it runs.
//!
//! # Order
//! Each side's engine messages leave in the order the engine emitted them: before the switch on
//! the control stream, the switch marker last there, every later one on this connection. The
//! receiving side handles the stream's messages in order up to the marker (the inbound task
//! forwards them to the poller's channel one by one, then `Command::DirectSwitch`), and only then
//! does the poller read this connection: a message sent here cannot be handled
//! before one sent on the stream earlier. The caller switches as soon as it has the connection
//! (the callee acknowledged the token, so it holds its end); the callee switches when the
//! caller's marker arrives (so a caller that could not set the connection up never switches, and
//! neither does the callee: both stay on the stream).
//!
//! On the connection, one buffer a link holds every framed byte not yet taken by the socket,
//! appended as the engine emits and sent from its front, whoever sends: a batch of actions'
//! end ([`super::Poller::send_direct`]), a later pass's retry of what the socket did not take
//! (`flush_direct`), a `Goodbye` sent at once (`close_peer`), the close's flusher thread (what is
//! left, once). A batch that finds bytes still unsent from an earlier one sends after them; a
//! partial write keeps its place (`sent`). So batching changes when bytes leave, never their
//! order.
//!
//! # Batched by batch of actions, not by pass
//! The messages a batch of actions emits for a peer (`run_actions`: after the commands and the
//! peers' messages, after the lane tests, after the landed chunks' consume) are framed into the
//! link and written with one `send` per link when the batch ends (`send_direct`), after its
//! posts. With 16 transfers of 64 KiB in flight on the CUDA stand-in that is 0.08–0.16 `send`s
//! a transfer on a WRITE's sender (6–12 headers a `send`), 0.10–0.31 on its receiver (3–10
//! `Done`s), 0.2–0.5 on a READ's reader and ~0.1 on its holder. Session 29 (ctlcork) tried one
//! `send` a pass: all at the pass's end, and two points (before the lane tests, at the end).
//! The `send`s fell by a tenth to a third, and the rate moved with the VM's load more than with
//! the variant: loaded, all-at-the-end lost a fifth or more of a 64 KiB WRITE's rate (a header
//! waiting behind the lane tests, a `Done` behind the consume) and gained on READ; lightly
//! loaded, even and 0.9–1.4× (docs/BENCHMARKS.md, "Session 29, ctlcork"). Kept as it was.

use std::collections::VecDeque;
use std::io::Read;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::Command;
use crate::engine::PeerMsg;

/// Bytes left unsent to a peer that reads nothing of its direct connection before the pairing
/// fails: a few of the largest control messages (`peers::MAX_CONTROL_MESSAGE`).
pub const MAX_UNSENT: usize = 256 << 20;

/// How much one read of a direct socket takes at most (a pass reads until a short read).
pub(super) const READ_BUF: usize = 64 << 10;

/// Turns a direct connection's bytes, in the order read, into the peer's messages (as
/// `Command::Message` / `Command::Malformed`), keeping a partial frame for the next bytes.
/// `Err`: the bytes break the protocol (the pairing fails with that reason).
pub type Decode = Box<dyn FnMut(&[u8], &mut VecDeque<Command>) -> Result<(), String> + Send>;

/// What the peers layer hands the poller for a pairing's direct control connection.
pub struct DirectConn {
    /// The connected socket, non-blocking: the poller reads it when epoll says so and sends with
    /// `MSG_DONTWAIT`.
    pub stream: Arc<TcpStream>,
    /// Frames an engine message for the wire (length prefix and `tcpxd.peer.v1` encoding: the
    /// peers layer's).
    pub frame: fn(&PeerMsg, &mut Vec<u8>),
    /// Decodes what the poller reads (the peers layer's frames and messages).
    pub decode: Decode,
    /// This side dialled it (the pairing's caller): it switches at once.
    pub caller: bool,
}

/// A pairing's direct control connection in the poller.
pub(super) struct DirectLink {
    conn: DirectConn,
    /// Framed messages not yet taken by the socket, from `sent` on.
    out: Vec<u8>,
    sent: usize,
    /// This side sends its engine messages here (its `DirectSwitch` went on the stream).
    pub(super) switched: bool,
    /// The poller reads the peer's messages (its `DirectSwitch` came), under this token of its
    /// epoll set (`park.rs`).
    pub(super) reading: Option<mio::Token>,
    /// The connection ended (EOF, an error, bad bytes: reported once) or was closed: not read.
    ended: bool,
    /// [`DirectLink::close`] ran.
    closed: bool,
    pub(super) messages_sent: u64,
    /// `send` calls made on the connection (tests: how many messages went in one).
    sends: u64,
}

impl DirectLink {
    pub(super) fn new(conn: DirectConn) -> DirectLink {
        DirectLink {
            conn,
            out: Vec::new(),
            sent: 0,
            switched: false,
            reading: None,
            ended: false,
            closed: false,
            messages_sent: 0,
            sends: 0,
        }
    }

    pub(super) fn caller(&self) -> bool {
        self.conn.caller
    }

    /// Reads the peer's messages from now on: the socket joins the poller's epoll set. The
    /// token, for a first read of what came already.
    pub(super) fn start_reading(
        &mut self,
        park: &mut super::park::Park,
        peer: crate::engine::PeerIdx,
    ) -> Result<mio::Token, String> {
        let token = park
            .register(self.conn.stream.as_raw_fd(), peer)
            .map_err(|e| format!("direct control connection: watching it: {e}"))?;
        self.reading = Some(token);
        Ok(token)
    }

    /// Frames `msg` for the next [`DirectLink::flush`] (the end of the batch of actions that
    /// sent it: `Poller::send_direct`), after every byte framed before it.
    pub(super) fn push(&mut self, msg: &PeerMsg) {
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
        (self.conn.frame)(msg, &mut self.out);
        self.messages_sent += 1;
    }

    /// Frames `msg` and sends what the socket takes now; the rest goes in later passes
    /// ([`DirectLink::flush`]). `Err`: the connection broke (the pairing fails).
    pub(super) fn send(&mut self, msg: &PeerMsg) -> Result<(), String> {
        self.push(msg);
        self.flush()
    }

    /// Bytes framed but not taken by the socket yet.
    pub(super) fn unsent(&self) -> usize {
        self.out.len() - self.sent
    }

    /// Sends what is left, as much as the socket takes without blocking.
    pub(super) fn flush(&mut self) -> Result<(), String> {
        let sock = socket2::SockRef::from(&*self.conn.stream);
        // The hop trace's split of a control message's way: framed (`poller.out`), sent here,
        // read by the peer's poller (`poller.read`), decoded (`wire.in`).
        tracing::trace!(target: "tcpxd::hop", hop = "poller.flush", pass = crate::lanes::pass(), bytes = self.out.len() - self.sent);
        while self.sent < self.out.len() {
            self.sends += 1;
            match sock.send_with_flags(&self.out[self.sent..], libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
                Ok(0) => return Err("direct control connection: the socket took nothing".into()),
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(format!("direct control connection: sending: {e}")),
            }
        }
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        } else if self.unsent() > MAX_UNSENT {
            return Err(format!(
                "direct control connection: the peer has not read {} bytes of control messages (at most {MAX_UNSENT} may wait)",
                self.unsent()
            ));
        }
        Ok(())
    }

    /// Ends the connection: what is framed and unsent (a `Goodbye`, a pairing close's answer)
    /// is sent first on one of a few flusher threads ([`flushers`]), bounded by `within`, so the
    /// poller never waits for a peer that reads nothing; then both directions shut down (the
    /// poller reads it no more).
    /// Once only (dropping the link closes it too).
    pub(super) fn close(&mut self, within: std::time::Duration) {
        self.ended = true;
        if std::mem::replace(&mut self.closed, true) {
            return;
        }
        tracing::debug!(
            messages = self.messages_sent,
            sends = self.sends,
            "direct control connection closing"
        );
        let rest = self.out.split_off(self.sent);
        self.out.clear();
        self.sent = 0;
        let stream = self.conn.stream.clone();
        if rest.is_empty() {
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
        let flush = move || {
            // The socket is non-blocking (the poller's epoll needs it): send what it takes,
            // wait a little while it is full, until `within`.
            let deadline = std::time::Instant::now() + within;
            let sock = socket2::SockRef::from(&*stream);
            let mut at = 0;
            while at < rest.len() && std::time::Instant::now() < deadline {
                match sock.send_with_flags(&rest[at..], libc::MSG_NOSIGNAL) {
                    Ok(0) => break,
                    Ok(n) => at += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(std::time::Duration::from_millis(1))
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let _ = stream.shutdown(Shutdown::Both);
        };
        flushers().run(Box::new(flush));
    }
}

/// The threads that flush closing direct connections: a few, started on demand and gone when
/// idle ([`super::closer::Closers`]), not a thread a close — many pairings closing at once (a
/// daemon's stop, a flapping peer) queue here instead. Each flush ends within its `within`, so
/// the queue drains; kept apart from the lanes' closers, whose closes can hang as long as a peer.
fn flushers() -> &'static std::sync::Arc<super::closer::Closers> {
    static FLUSHERS: std::sync::OnceLock<std::sync::Arc<super::closer::Closers>> = std::sync::OnceLock::new();
    FLUSHERS.get_or_init(|| {
        super::closer::Closers::new("tcpxd-direct-close", MAX_FLUSHERS, super::closer::LINGER)
    })
}

/// At most this many threads flush closing direct connections at once.
const MAX_FLUSHERS: usize = 4;

impl Drop for DirectLink {
    fn drop(&mut self) {
        self.close(CLOSE_FLUSH);
    }
}

/// How long a pairing whose peer ended its control stream waits for the peer's direct
/// connection to end too before it fails (the peer's end of both comes at once).
pub(super) const STREAM_END_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a closing direct connection may take to send what was left (a `Goodbye`, a pairing
/// close's answer) before it is shut down anyway.
pub(super) const CLOSE_FLUSH: std::time::Duration = std::time::Duration::from_secs(2);

impl super::Poller {
    /// `Command::DirectControl`: the pairing's direct connection is set up. The caller switches
    /// its outbound messages to it at once (the marker last on the stream); the callee when the
    /// caller's marker comes. A connection for a pairing that failed, closed or is gone is shut.
    pub(super) fn direct_control(&mut self, peer: crate::engine::PeerIdx, conn: DirectConn) {
        let closed = self.engine.pairing_life(peer) == Some(crate::engine::PairLife::Closed);
        let Some(p) = self.peers.get_mut(&peer).filter(|p| !p.failed && !closed) else {
            drop(DirectLink::new(conn));
            return;
        };
        let mut link = DirectLink::new(conn);
        if link.caller() {
            let _ = p.control.send(super::ControlOut::DirectSwitch);
            link.switched = true;
        }
        tracing::debug!(peer = %p.node_id, caller = link.caller(), "direct control connection up");
        if let Some(mut old) = p.direct.replace(link) {
            old.close(CLOSE_FLUSH);
        }
    }

    /// `Command::DirectSwitch`: every message the peer sent on its stream before the marker has
    /// been handled; its reader may forward the rest. The callee switches its own messages now.
    pub(super) fn direct_switch(&mut self, peer: crate::engine::PeerIdx) {
        let Some(p) = self.peers.get_mut(&peer).filter(|p| !p.failed) else {
            return;
        };
        let why = match p.direct.as_mut() {
            None => "the peer switched to a direct control connection this daemon does not have".into(),
            Some(d) if d.reading.is_some() => {
                "the peer switched to its direct control connection twice".into()
            }
            Some(d) => match d.start_reading(&mut self.park, peer) {
                Ok(token) => {
                    // What came before the switch was handled: read what waits already.
                    self.direct_ready.push(token);
                    if !d.switched {
                        let _ = p.control.send(super::ControlOut::DirectSwitch);
                        d.switched = true;
                    }
                    return;
                }
                Err(why) => why,
            },
        };
        self.direct_broken.push((peer, why));
    }

    /// `Command::ControlStreamEnded`. Before the peer switched: the pairing fails. After: the
    /// peer's last messages (a pairing close's answer, a `Goodbye`) come on the direct
    /// connection, which the peer closes after them, and may arrive after the stream's end on
    /// the other connection: that end decides (the poller reads it), within
    /// [`STREAM_END_GRACE`].
    pub(super) fn stream_ended(&mut self, peer: crate::engine::PeerIdx, reason: String) {
        match self.peers.get_mut(&peer) {
            Some(p) if p.direct.as_ref().is_some_and(|d| d.reading.is_some()) => {
                if p.stream_ended.is_none() {
                    p.stream_ended = Some((std::time::Instant::now(), reason));
                }
            }
            _ => self.engine.on_peer_failed(peer, &reason),
        }
    }

    /// Sends the messages a batch of actions framed (`send_control`), once the batch's posts are
    /// made: a header leaves after its sends are posted (on two busy CPUs the peer's reader,
    /// woken by the `send`, may take this thread's CPU at once), and `Done` with the credits the
    /// same batch returned.
    pub(super) fn send_direct(&mut self) {
        for peer in std::mem::take(&mut self.direct_pending) {
            if let Some(d) = self.peers.get_mut(&peer).and_then(|p| p.direct.as_mut())
                && d.unsent() > 0
            {
                if let Err(why) = d.flush() {
                    self.direct_broken.push((peer, why));
                }
            }
        }
    }

    /// When the first pairing whose control stream ended with its direct connection open is due
    /// to fail ([`STREAM_END_GRACE`] after the end; `flush_direct`): the one timer of the poller
    /// that the engine's `next_deadline` does not know, so the park's timeout counts it too.
    pub(super) fn stream_end_due(&self) -> Option<std::time::Instant> {
        self.peers
            .values()
            .filter(|p| !p.failed)
            .filter_map(|p| p.stream_ended.as_ref())
            .map(|(at, _)| *at + STREAM_END_GRACE)
            .min()
    }

    /// Sends what the pairings' direct connections could not take earlier, and fails the
    /// pairings whose connection broke (in this pass or while an action sent on it), or whose
    /// control stream ended [`STREAM_END_GRACE`] ago with the direct connection still open.
    /// True when a pairing failed (its actions ran).
    pub(super) fn flush_direct(&mut self) -> bool {
        for (&peer, p) in self.peers.iter_mut() {
            if p.failed {
                continue;
            }
            if let Some(d) = p.direct.as_mut().filter(|d| d.unsent() > 0)
                && let Err(why) = d.flush()
            {
                self.direct_broken.push((peer, why));
            }
            if let Some((at, why)) = &p.stream_ended
                && at.elapsed() > STREAM_END_GRACE
            {
                self.direct_broken
                    .push((peer, format!("{why} (its direct control connection stayed open)")));
                p.stream_ended = None;
            }
        }
        if self.direct_broken.is_empty() {
            return false;
        }
        for (peer, why) in std::mem::take(&mut self.direct_broken) {
            self.engine.on_peer_failed(peer, &why);
        }
        self.run_actions();
        true
    }
}

impl super::Poller {
    /// Some pairing's direct socket is in the epoll set: a pass looks at them (no syscall
    /// otherwise: the control stream's pairings, a daemon without peers).
    pub(super) fn reads_direct(&self) -> bool {
        self.peers
            .values()
            .any(|p| p.direct.as_ref().is_some_and(|d| d.reading.is_some() && !d.ended))
    }

    /// Reads the direct sockets epoll reported (`park.rs`) until each has nothing more now, and
    /// queues the peers' messages they carried with the commands (`inbound`), in order; a
    /// connection's end, error or bad bytes is queued after its last message as the pairing's
    /// failure (`Command::PeerDown`), so a `Goodbye` before it is handled first. True when
    /// something was read.
    pub(super) fn read_direct(&mut self) -> bool {
        if self.direct_ready.is_empty() {
            return false;
        }
        let mut got = false;
        let mut ready = std::mem::take(&mut self.direct_ready);
        for token in ready.drain(..) {
            let (peer, _) = super::park::direct_peer(token);
            let Some(p) = self.peers.get_mut(&peer).filter(|p| !p.failed) else {
                continue;
            };
            let Some(d) = p.direct.as_mut().filter(|d| d.reading == Some(token) && !d.ended) else {
                // A link closed or replaced since: its late event.
                continue;
            };
            let ended = loop {
                match (&*d.conn.stream).read(&mut self.read_buf) {
                    Ok(0) => break Some("closed by the peer".to_string()),
                    Ok(n) => {
                        got = true;
                        tracing::trace!(target: "tcpxd::hop", hop = "poller.read", pass = crate::lanes::pass(), bytes = n);
                        if let Err(why) = (d.conn.decode)(&self.read_buf[..n], &mut self.inbound) {
                            break Some(why);
                        }
                        // Short: the socket is empty now (any later byte raises a new edge).
                        if n < self.read_buf.len() {
                            break None;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break None,
                    Err(e) => break Some(e.to_string()),
                }
            };
            if let Some(reason) = ended {
                got = true;
                d.ended = true;
                tracing::debug!(peer = %p.node_id, "direct control connection: {reason}");
                self.inbound.push_back(Command::PeerDown {
                    peer,
                    reason: format!("direct control connection: {reason}"),
                });
            }
        }
        self.direct_ready = ready;
        got
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::io::Read;
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::Arc;

    use super::{Command, DirectConn, DirectLink};
    use crate::engine::{PeerIdx, PeerMsg, ReturnedCredits};
    use crate::peers::direct::{decoder, frame_msg};

    /// A link over a loopback connection, and the peer's end (blocking), with the socket
    /// buffers as small as the kernel allows when `small`.
    fn link(small: bool) -> (DirectLink, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (theirs, _) = listener.accept().unwrap();
        if small {
            socket2::SockRef::from(&ours).set_send_buffer_size(4096).unwrap();
            socket2::SockRef::from(&theirs)
                .set_recv_buffer_size(4096)
                .unwrap();
        }
        ours.set_nonblocking(true).unwrap();
        ours.set_nodelay(true).unwrap();
        let conn = DirectConn {
            stream: Arc::new(ours),
            frame: frame_msg,
            decode: decoder(PeerIdx(1)),
            caller: true,
        };
        (DirectLink::new(conn), theirs)
    }

    fn done(id: u64) -> PeerMsg {
        PeerMsg::Done {
            offer_id: id,
            returned: ReturnedCredits::from_wire(vec![id as u32 % 7, 1]),
        }
    }

    /// A message of about `len` bytes on the wire: an inline transfer's.
    fn big(id: u64, len: usize) -> PeerMsg {
        PeerMsg::Inline {
            offer: crate::engine::Offer {
                offer_id: id,
                read_id: 0,
                chunk_bytes: 65536,
                first_lane: 0,
                ranges: vec![crate::engine::RemoteRange {
                    buffer_id: 2,
                    access_key: [1; 16],
                    offset: 0,
                    length: len as u64,
                }]
                .into(),
                notification: Vec::new(),
                deadline_ms: 0,
                blocks: None,
                coalesced: false,
                transfer_id: id,
                announced: None,
            },
            payload: (0..len).map(|i| (i as u64 ^ id) as u8).collect(),
        }
    }

    /// Reads what the peer's end has until `want` messages came, decoded in order.
    fn read_msgs(theirs: &mut TcpStream, want: usize, link: &mut DirectLink) -> Vec<PeerMsg> {
        let mut decode = decoder(PeerIdx(1));
        let mut cmds = VecDeque::new();
        let mut buf = vec![0u8; 1 << 16];
        theirs.set_nonblocking(true).unwrap();
        while cmds.len() < want {
            // What the link could not hand over yet goes as the reader makes room.
            link.flush().unwrap();
            match theirs.read(&mut buf) {
                Ok(0) => panic!("the link's end closed"),
                Ok(n) => decode(&buf[..n], &mut cmds).unwrap(),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        theirs.set_nonblocking(false).unwrap();
        cmds.into_iter()
            .map(|c| match c {
                Command::Message { msg, .. } => msg,
                _ => panic!("a message"),
            })
            .collect()
    }

    #[test]
    fn a_batch_of_messages_leaves_in_one_send_in_order() {
        let (mut link, mut theirs) = link(false);
        let msgs: Vec<PeerMsg> = (0..16).map(done).collect();
        for m in &msgs {
            link.push(m);
        }
        assert_eq!(link.sends, 0, "pushed, not sent");
        link.flush().unwrap();
        assert_eq!((link.sends, link.unsent(), link.messages_sent), (1, 0, 16));
        assert_eq!(read_msgs(&mut theirs, 16, &mut link), msgs);
        // A lone message is one send of its own, and nothing is sent for nothing.
        link.flush().unwrap();
        link.push(&done(99));
        link.flush().unwrap();
        assert_eq!(link.sends, 2);
        assert_eq!(read_msgs(&mut theirs, 1, &mut link), vec![done(99)]);
    }

    #[test]
    fn a_batch_that_fills_the_socket_keeps_the_rest_and_the_order_across_batches() {
        let (mut link, mut theirs) = link(true);
        // Batches of a few large messages and small ones between, far more than the socket's
        // buffers hold: each flush takes what fits, later batches queue behind the rest.
        let mut msgs = Vec::new();
        let mut filled = false;
        for batch in 0..8u64 {
            for i in 0..4u64 {
                let id = batch * 10 + i;
                let m = if i % 2 == 0 { big(id, 24_000) } else { done(id) };
                link.push(&m);
                msgs.push(m);
            }
            link.flush().unwrap();
            filled |= link.unsent() > 0;
        }
        assert!(
            filled,
            "the socket took every batch at once ({} sends)",
            link.sends
        );
        assert!(link.unsent() > 0);
        let got = read_msgs(&mut theirs, msgs.len(), &mut link);
        assert_eq!(got.len(), msgs.len());
        assert!(
            got == msgs,
            "messages out of order across batches and partial writes"
        );
        link.flush().unwrap();
        assert_eq!(link.unsent(), 0);
    }

    #[test]
    fn a_broken_socket_fails_the_flush_naming_it() {
        let (mut link, theirs) = link(false);
        drop(theirs);
        link.conn.stream.shutdown(Shutdown::Write).unwrap();
        link.push(&done(1));
        let e = link.flush().unwrap_err();
        assert!(e.starts_with("direct control connection: sending: "), "{e}");
    }
}
