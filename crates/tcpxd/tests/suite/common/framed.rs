//! A framed local session (the `Session` RPC on the API unix socket without gRPC) driven with a
//! plain `UnixStream`, as a client without gRPC drives it; with file descriptors sent along
//! (SCM_RIGHTS) for `register_host_fd`.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use prost::Message;
use tcpxd::api::local::frame::put_frame;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;

pub const PREFACE: &[u8; 8] = b"TCPXD/1\n";

/// A framed session over its own connection, as a client without gRPC drives it.
pub struct Framed {
    pub io: UnixStream,
}

impl Framed {
    pub async fn open(path: &Path) -> Framed {
        Framed::open_with(path, &[]).await
    }

    /// Opens a session whose first bytes (`first`: frames) go with the preface, in one write,
    /// before the daemon answered it.
    pub async fn open_with(path: &Path, first: &[u8]) -> Framed {
        let mut io = UnixStream::connect(path).await.expect("connect");
        let mut hello = PREFACE.to_vec();
        hello.extend_from_slice(first);
        io.write_all(&hello).await.unwrap();
        let mut answer = [0u8; 8];
        tokio::time::timeout(Duration::from_secs(30), io.read_exact(&mut answer))
            .await
            .expect("the preface answered within 30 s")
            .expect("the preface answered");
        assert_eq!(&answer, PREFACE);
        Framed { io }
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.io.write_all(bytes).await.expect("connection open");
    }

    pub async fn send(&mut self, tag: u64, op: Op) {
        self.send_request(pb::SessionRequest { tag, op: Some(op) }).await;
    }

    pub async fn send_request(&mut self, req: pb::SessionRequest) {
        let mut frame = Vec::new();
        put_frame(&mut frame, &req).expect("a Vec grows");
        self.send_raw(&frame).await;
    }

    /// The next event, or `None` at a clean EOF.
    pub async fn next_or_eof(&mut self) -> Option<pb::SessionEvent> {
        tokio::time::timeout(Duration::from_secs(30), async {
            let mut head = [0u8; 4];
            match self.io.read_exact(&mut head).await {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return None,
                Err(e) => panic!("reading an event: {e}"),
            }
            let mut body = vec![0u8; u32::from_be_bytes(head) as usize];
            self.io.read_exact(&mut body).await.expect("a whole frame");
            Some(pb::SessionEvent::decode(&body[..]).expect("a SessionEvent"))
        })
        .await
        .expect("an event or EOF within 30 s")
    }

    pub async fn next(&mut self) -> pb::SessionEvent {
        self.next_or_eof().await.expect("an event, not EOF")
    }

    pub async fn assert_eof(&mut self) {
        if let Some(ev) = self.next_or_eof().await {
            panic!("expected EOF, got {ev:?}");
        }
    }
}

pub async fn half_close(f: &mut Framed) {
    f.io.shutdown().await.expect("half-close");
}

pub fn finished(ev: &pb::SessionEvent) -> &pb::TransferEvent {
    match &ev.event {
        Some(Event::Finished(t)) => t,
        other => panic!("tag {}: expected a finished event, got {other:?}", ev.tag),
    }
}

pub fn refused(ev: pb::SessionEvent) -> (u64, i32, String) {
    match ev.event {
        Some(Event::Refused(st)) => (ev.tag, st.code, st.message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

impl Framed {
    /// Sends a request with the file descriptor `fd` attached to its frame (SCM_RIGHTS), in one
    /// sendmsg, as `register_host_fd` wants.
    pub async fn send_with_fd(&mut self, tag: u64, op: Op, fd: impl AsFd) {
        self.send_with_fds(tag, op, &[fd.as_fd()]).await
    }

    /// Sends a request with the file descriptors `fds` attached to its frame, in this order (at
    /// most 64), in one sendmsg, as `register_batch` wants.
    pub async fn send_with_fds(&mut self, tag: u64, op: Op, fds: &[std::os::fd::BorrowedFd<'_>]) {
        let mut frame = Vec::new();
        put_frame(&mut frame, &pb::SessionRequest { tag, op: Some(op) }).expect("a Vec grows");
        loop {
            self.io.writable().await.expect("connection open");
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(64))];
            let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
            assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(fds)));
            let sent = self.io.try_io(Interest::WRITABLE, || {
                rustix::net::sendmsg(
                    &self.io,
                    &[IoSlice::new(&frame)],
                    &mut control,
                    rustix::net::SendFlags::DONTWAIT,
                )
                .map_err(std::io::Error::from)
            });
            match sent {
                Ok(n) => {
                    // The descriptor went with the first byte; the rest of a frame may follow.
                    self.io.write_all(&frame[n..]).await.expect("connection open");
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => panic!("sendmsg: {e}"),
            }
        }
    }

    /// The buffer a `register_host_fd` answer carries, or the refusal's (code, message).
    pub async fn registered(&mut self, tag: u64) -> Result<pb::Buffer, (i32, String)> {
        let ev = self.next().await;
        assert_eq!(ev.tag, tag);
        match ev.event {
            Some(Event::Registered(b)) => Ok(b),
            Some(Event::Refused(st)) => Err((st.code, st.message)),
            other => panic!("tag {tag}: expected a registration's answer, got {other:?}"),
        }
    }
}
