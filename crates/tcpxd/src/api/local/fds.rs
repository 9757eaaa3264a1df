//! File descriptors on the framed local session: a client registering its own host memory sends
//! the memory's descriptor (SCM_RIGHTS) in the same `sendmsg` as the `register_host_fd` frame.
//!
//! The kernel delivers a descriptor with the first byte of the message it was sent with, and a
//! `recvmsg` that brings descriptors ends within the message that carried them (it may begin with
//! earlier messages' bytes). So [`FdReader`] reads with `recvmsg`, counts the bytes, and files
//! each batch of descriptors under the byte range `[s, e)` of the read that brought it;
//! [`Positioned`] counts the bytes of the frames it decodes; the frame `[x, y)` owns the batch with
//! `s <= x < e <= y`: it starts within the read and the read ends within it (a frame that came
//! earlier in the same read ends before the owner starts). Batches no frame claimed (a client
//! that sent descriptors with other frames) are closed as the frames pass them. Safe code only:
//! rustix's `recvmsg` hands the descriptors over as `OwnedFd`s (close-on-exec).
//!
//! The connection is registered with the runtime for reading only ([`AsyncFd`] with
//! `Interest::READABLE`): a registration that also asked for writability (tokio's `UnixStream`
//! does) is woken by every event the client reads — the kernel wakes a socket's EPOLLOUT waiters
//! when the peer's read frees its send buffer — so each answer cost the client's `recv` the wake
//! of a parked runtime worker (1.8 → 6.1–6.4 µs a `recv` on the 2-core VM) and the daemon a
//! worker woken for nothing (docs/BENCHMARKS.md, "Session 23, client-leg").

use std::collections::VecDeque;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::BytesMut;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
use std::os::unix::net::UnixStream;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, ReadBuf};
use tokio_util::codec::Decoder;
use tonic::Status;

use super::frame::{FrameError, RequestDecoder};
use crate::api::proto::v1 as pb;

/// Descriptors one `sendmsg` may carry (a `register_batch` of 64 memfds); more are cut off by
/// the kernel (and the frame refused).
const MAX_FDS: usize = crate::api::register_batch::MAX_BATCH;

/// Batches kept waiting for their frame; past this the oldest are closed (a client spraying
/// descriptors cannot make the daemon hold them).
const MAX_BATCHES: usize = 16;

/// Descriptors that came with one read.
#[derive(Debug)]
struct Batch {
    /// Stream offsets of the read's first byte and one past its last.
    start: u64,
    end: u64,
    fds: Vec<OwnedFd>,
    /// The kernel cut the batch short (more than [`MAX_FDS`], or no room).
    truncated: bool,
}

/// `io` registered with the current runtime for `interest` only (tokio's own socket types always
/// ask for both directions).
///
/// tokio deprecated this constructor (#8587) because, generic over any `AsRawFd`, it cannot
/// know that the descriptor stays the same while registered; for an owned `UnixStream` it does
/// (the stream is moved in and its descriptor never changes), which is what the unsafe
/// replacement asks its caller to promise — without an `unsafe` block outside the FFI edges.
#[allow(deprecated)]
pub fn register(io: UnixStream, interest: tokio::io::Interest) -> io::Result<AsyncFd<UnixStream>> {
    AsyncFd::with_interest(io, interest)
}

/// Who tells a session's reader that its socket has bytes.
enum Source {
    /// The runtime's reactor (registered for reading only).
    Runtime(AsyncFd<UnixStream>),
    /// The poller's epoll set (`runtime.poller_sessions`: `crate::poller::SessionWatch`); its
    /// registration first, so it leaves the set before the socket closes.
    Poller(crate::poller::Watching, UnixStream),
}

/// The request side of a local session, read with `recvmsg` so descriptors can come along.
pub struct FdReader {
    io: Source,
    files: Files,
}

/// What came with the reads: their byte count, and the descriptors by byte range.
#[derive(Default)]
struct Files {
    /// Bytes read so far (after the preface).
    received: u64,
    batches: VecDeque<Batch>,
}

impl FdReader {
    /// Reads `io` (non-blocking), registered with the current runtime for reading only.
    pub fn new(io: UnixStream) -> io::Result<FdReader> {
        io.set_nonblocking(true)?;
        Ok(FdReader {
            io: Source::Runtime(register(io, tokio::io::Interest::READABLE)?),
            files: Files::default(),
        })
    }

    /// Reads `io` (non-blocking), woken by the poller when it has bytes (`watch`'s set).
    pub fn on_poller(
        io: UnixStream,
        watch: &std::sync::Arc<crate::poller::SessionWatch>,
    ) -> io::Result<FdReader> {
        use std::os::fd::AsRawFd;
        io.set_nonblocking(true)?;
        let watching = watch.watch(io.as_raw_fd())?;
        Ok(FdReader {
            io: Source::Poller(watching, io),
            files: Files::default(),
        })
    }

    /// How many request frames wait in the socket: the bytes queued (`FIONREAD`), and past the
    /// first frame, whose length is peeked (`MSG_PEEK`: nothing is taken, a descriptor sent with
    /// it stays for the read). [`Queued::One`] where the runtime reads the socket, or a look
    /// fails (the caller reads).
    pub fn queued(&self) -> Queued {
        let Source::Poller(_, io) = &self.io else {
            return Queued::One;
        };
        let queued = match rustix::io::ioctl_fionread(io) {
            Ok(0) => return Queued::Nothing,
            Ok(n) => n,
            Err(_) => return Queued::One,
        };
        let mut head = [0u8; 4];
        match rustix::net::recv(io, &mut head[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Ok((4, _)) if queued > 4 + u64::from(u32::from_be_bytes(head)) => Queued::More,
            _ => Queued::One,
        }
    }

    /// Hands the next read to the thread that serves the sessions
    /// (`crate::poller::Watching::hand_over`): the registration to renew once the caller's poll
    /// ended, or `None` when the runtime reads this socket (there is no such thread).
    pub fn hand_over(&self, waker: &std::task::Waker) -> Option<crate::poller::Rearm> {
        match &self.io {
            Source::Poller(watching, _) => Some(watching.hand_over(waker)),
            Source::Runtime(_) => None,
        }
    }

    /// The one descriptor that came with the frame at stream offsets `[start, end)`. Batches
    /// that came wholly before it are closed.
    pub fn take(&mut self, at: (u64, u64)) -> Result<OwnedFd, Status> {
        let Some((fds, truncated)) = self.files.take_batch(at) else {
            return Err(Status::invalid_argument(
                "register_host_fd: no file descriptor came with this request (send it as SCM_RIGHTS \
                 in the same sendmsg as the request's frame)",
            ));
        };
        match (truncated, <[OwnedFd; 1]>::try_from(fds)) {
            (false, Ok([fd])) => Ok(fd),
            (truncated, Err(fds)) => Err(Status::invalid_argument(format!(
                "register_host_fd: {}{} file descriptors came with this request; send exactly one",
                fds.len(),
                if truncated { " or more" } else { "" },
            ))),
            (true, Ok(_)) => Err(Status::invalid_argument(
                "register_host_fd: more than one file descriptor came with this request; send exactly one",
            )),
        }
    }

    /// The `n` descriptors that came with the frame at `[start, end)` (a `register_batch`), in
    /// the order they were sent; none taken when `n` is 0 (a stray batch is closed as frames
    /// pass it).
    pub fn take_n(&mut self, at: (u64, u64), n: usize) -> Result<Vec<OwnedFd>, Status> {
        if n == 0 {
            return Ok(Vec::new());
        }
        match self.files.take_batch(at) {
            Some((fds, false)) if fds.len() == n => Ok(fds),
            Some((fds, truncated)) => Err(Status::invalid_argument(format!(
                "register_batch: {}{} file descriptors came with this request for {n} host_fd entries; \
                 send one per host_fd entry (at most {MAX_FDS})",
                fds.len(),
                if truncated { " or more" } else { "" },
            ))),
            None => Err(Status::invalid_argument(format!(
                "register_batch: no file descriptor came with this request for its {n} host_fd entries \
                 (send them as SCM_RIGHTS in the same sendmsg as the request's frame)"
            ))),
        }
    }
}

impl Files {
    /// One `recvmsg` into `dst` without waiting; its descriptors filed under its byte range.
    fn recv(&mut self, io: &UnixStream, dst: &mut [u8]) -> io::Result<usize> {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = rustix::net::recvmsg(
            io,
            &mut [io::IoSliceMut::new(dst)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
        )
        .map_err(io::Error::from)?;
        let mut fds = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                fds.extend(rights);
            }
        }
        let truncated = msg.flags.contains(ReturnFlags::CTRUNC);
        let start = self.received;
        self.received += msg.bytes as u64;
        if !fds.is_empty() || truncated {
            self.keep(Batch {
                start,
                end: self.received.max(start + 1),
                fds,
                truncated,
            });
        }
        Ok(msg.bytes)
    }

    /// The descriptors that came with the frame at `[start, end)`, and whether the kernel cut
    /// them short. Batches that came wholly before it are closed.
    fn take_batch(&mut self, (start, end): (u64, u64)) -> Option<(Vec<OwnedFd>, bool)> {
        while self.batches.front().is_some_and(|b| b.end <= start) {
            self.batches.pop_front();
        }
        let owned = |b: &Batch| b.start <= start && start < b.end && b.end <= end;
        let i = self.batches.iter().position(owned)?;
        let batch = self.batches.remove(i).expect("found above");
        Some((batch.fds, batch.truncated))
    }

    fn keep(&mut self, batch: Batch) {
        if self.batches.len() == MAX_BATCHES {
            self.batches.pop_front();
        }
        self.batches.push_back(batch);
    }
}

impl AsyncRead for FdReader {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let dst = buf.initialize_unfilled();
        let n = match &this.io {
            Source::Poller(watching, io) => match watching.watched().poll(cx, || this.files.recv(io, dst)) {
                Some(r) => r?,
                None => return Poll::Pending,
            },
            Source::Runtime(afd) => loop {
                let mut guard = ready!(afd.poll_read_ready(cx))?;
                match guard.try_io(|io| this.files.recv(io.get_ref(), dst)) {
                    Ok(Ok(n)) => break n,
                    Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Ok(Err(e)) => return Poll::Ready(Err(e)),
                    // Not readable after all (readiness cleared): wait for the next edge.
                    Err(_would_block) => continue,
                }
            },
        };
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

/// What waits in a session's socket ([`FdReader::queued`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queued {
    /// No byte.
    Nothing,
    /// One frame, or part of one.
    One,
    /// More than one frame.
    More,
}

/// [`RequestDecoder`], counting the bytes of the frames it decodes: where the last one started.
#[derive(Debug, Default)]
pub struct Positioned {
    consumed: u64,
    last_start: u64,
}

impl Positioned {
    /// The stream offsets `[start, end)` of the frame decoded last.
    pub fn last_frame(&self) -> (u64, u64) {
        (self.last_start, self.consumed)
    }

    fn counted(
        &mut self,
        src: &mut BytesMut,
        decode: impl FnOnce(&mut BytesMut) -> Result<Option<pb::SessionRequest>, FrameError>,
    ) -> Result<Option<pb::SessionRequest>, FrameError> {
        let before = src.len();
        let req = decode(src)?;
        if req.is_some() {
            self.last_start = self.consumed;
            self.consumed += (before - src.len()) as u64;
        }
        Ok(req)
    }
}

impl Decoder for Positioned {
    type Item = pb::SessionRequest;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<pb::SessionRequest>, FrameError> {
        self.counted(src, |src| RequestDecoder.decode(src))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<pb::SessionRequest>, FrameError> {
        self.counted(src, |src| RequestDecoder.decode_eof(src))
    }
}

#[cfg(test)]
mod tests {
    use std::io::IoSlice;

    use prost::Message;
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use tokio_stream::StreamExt;
    use tokio_util::codec::FramedRead;

    use super::*;
    use crate::api::proto::v1::session_request::Op;

    fn frame(tag: u64, op: Op) -> Vec<u8> {
        let body = pb::SessionRequest { tag, op: Some(op) }.encode_to_vec();
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend(body);
        v
    }

    fn register(tag: u64) -> Vec<u8> {
        frame(
            tag,
            Op::RegisterHostFd(pb::RegisterHostFdRequest {
                reattach_id: Default::default(),
                reattach_key: Default::default(),
                offset: 0,
                size: tag,
                label: String::new(),
                block_lists: Vec::new(),
            }),
        )
    }

    /// Sends `bytes` with `fds` attached, in one sendmsg.
    fn send_with(sock: &std::os::unix::net::UnixStream, bytes: &[u8], fds: &[&OwnedFd]) {
        use std::os::fd::AsFd;
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !borrowed.is_empty() {
            assert!(control.push(SendAncillaryMessage::ScmRights(&borrowed)));
        }
        let n = rustix::net::sendmsg(sock, &[IoSlice::new(bytes)], &mut control, SendFlags::empty()).unwrap();
        assert_eq!(n, bytes.len());
    }

    fn ino(fd: &OwnedFd) -> u64 {
        rustix::fs::fstat(fd).unwrap().st_ino
    }

    /// The epoll events every epoll set of this process asks for `fd` (from /proc/self/fdinfo).
    fn epoll_masks(fd: i32) -> Vec<u32> {
        let mut masks = Vec::new();
        for entry in std::fs::read_dir("/proc/self/fdinfo").unwrap().flatten() {
            let Ok(info) = std::fs::read_to_string(entry.path()) else {
                continue;
            };
            for line in info.lines().filter(|l| l.starts_with("tfd:")) {
                let mut words = line.split_whitespace();
                let tfd = words.nth(1).and_then(|w| w.parse::<i32>().ok());
                let events = words.nth(1).and_then(|w| u32::from_str_radix(w, 16).ok());
                if let (Some(t), Some(ev)) = (tfd, events)
                    && t == fd
                {
                    masks.push(ev);
                }
            }
        }
        masks
    }

    /// What waits in a watched socket, told without taking anything: nothing, part of a frame,
    /// one frame, more; a descriptor sent with the first frame stays for the read.
    #[tokio::test]
    async fn queued_tells_nothing_one_or_more_frames_and_takes_nothing() {
        let poll = mio::Poll::new().unwrap();
        let watch = std::sync::Arc::new(crate::poller::SessionWatch::new(
            poll.registry().try_clone().unwrap(),
        ));
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let reader = FdReader::on_poller(ours, &watch).unwrap();
        assert_eq!(reader.queued(), Queued::Nothing);
        let file = OwnedFd::from(tempfile_like());
        let first = register(10);
        send_with(&theirs, &first[..2], &[]);
        assert_eq!(reader.queued(), Queued::One, "part of the length");
        send_with(&theirs, &first[2..], &[&file]);
        assert_eq!(reader.queued(), Queued::One, "one frame");
        send_with(&theirs, &frame(2, Op::CancelTag(9))[..3], &[]);
        assert_eq!(reader.queued(), Queued::More, "one frame and part of the next");
        assert_eq!(reader.queued(), Queued::More, "looked at twice: nothing taken");
        // Where the runtime reads (no serving thread): the caller reads.
        let (plain, _other) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(FdReader::new(plain).unwrap().queued(), Queued::One);
        // The frames and the descriptor read whole after the looks.
        drop(theirs);
        let mut framed = FramedRead::new(reader, Positioned::default());
        let req = framed.next().await.unwrap().unwrap();
        assert_eq!(req.tag, 10);
        let at = framed.decoder().last_frame();
        assert_eq!(framed.get_mut().take(at).map(|fd| ino(&fd)).unwrap(), ino(&file));
    }

    #[tokio::test]
    async fn the_connection_is_registered_for_reading_only() {
        use std::os::fd::AsRawFd;
        const EPOLLIN: u32 = 0x1;
        const EPOLLOUT: u32 = 0x4;
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = ours.as_raw_fd();
        let reader = FdReader::new(ours).unwrap();
        let masks = epoll_masks(fd);
        assert!(!masks.is_empty(), "registered");
        // Asked for, EPOLLOUT would wake a parked worker on every read the client makes.
        assert!(
            masks.iter().all(|m| m & EPOLLIN != 0 && m & EPOLLOUT == 0),
            "{masks:x?}"
        );
        drop(reader);
        // What tokio's own socket asks for (why the reader does not use it).
        let (plain, _other) = tokio::net::UnixStream::pair().unwrap();
        let masks = epoll_masks(plain.as_raw_fd());
        assert!(masks.iter().any(|m| m & EPOLLOUT != 0), "{masks:x?}");
    }

    #[tokio::test]
    async fn each_registration_gets_the_descriptor_sent_with_its_frame() {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let files: Vec<OwnedFd> = (0..3).map(|_| OwnedFd::from(tempfile_like())).collect();
        // A plain frame, then three registrations each with its descriptor, then a frame that
        // brings a stray descriptor, then a registration without one: all in the socket before
        // the daemon reads any, so reads glue them as the kernel allows.
        send_with(&theirs, &frame(1, Op::CancelTag(9)), &[]);
        for (i, f) in files.iter().enumerate() {
            send_with(&theirs, &register(10 + i as u64), &[f]);
        }
        send_with(&theirs, &frame(2, Op::CancelTag(9)), &[&files[0]]);
        send_with(&theirs, &register(20), &[]);
        send_with(&theirs, &register(21), &[&files[1], &files[2]]);
        drop(theirs);
        let mut framed = FramedRead::new(FdReader::new(ours).unwrap(), Positioned::default());
        let mut got = Vec::new();
        while let Some(req) = framed.next().await {
            let req = req.unwrap();
            let at = framed.decoder().last_frame();
            if let Some(Op::RegisterHostFd(r)) = &req.op {
                got.push((r.size, framed.get_mut().take(at).map(|fd| ino(&fd))));
            }
        }
        let inos: Vec<u64> = files.iter().map(ino).collect();
        assert_eq!(got.len(), 5);
        for i in 0..3 {
            assert_eq!(got[i].0, 10 + i as u64);
            assert_eq!(
                *got[i].1.as_ref().unwrap(),
                inos[i],
                "registration {i} got its own file"
            );
        }
        let none = got[3].1.as_ref().unwrap_err();
        assert!(none.message().contains("no file descriptor came"), "{none:?}");
        let two = got[4].1.as_ref().unwrap_err();
        assert!(two.message().contains("send exactly one"), "{two:?}");
        assert!(
            framed.get_ref().files.batches.is_empty(),
            "the stray descriptor was closed"
        );
    }

    /// A distinct unlinked file.
    fn tempfile_like() -> std::fs::File {
        let fd = rustix::fs::memfd_create("tcpxd-fds-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        std::fs::File::from(fd)
    }
}
