//! The framed local session as the daemon bench drives it (`--via local`): the `Session` RPC's
//! requests and events over the daemon's API unix socket without HTTP/2 (docs/API.md, "The
//! framed local session"), as the Python package's client uses it. After the preface each way,
//! a frame is a 4-byte big-endian length and that many bytes of protobuf (`SessionRequest` out,
//! `SessionEvent` in).

use std::io;
use std::path::Path;

use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use tcpxd::api::local::frame::{MAX_FRAME, PREFACE, put_frame};
use tcpxd::api::proto::v1::{SessionEvent, SessionRequest};

/// One framed session on a daemon's API socket.
pub struct LocalSession {
    read: BufReader<OwnedReadHalf>,
    write: OwnedWriteHalf,
    /// Frames queued by [`LocalSession::queue`], written by [`LocalSession::flush`].
    out: Vec<u8>,
    body: Vec<u8>,
}

impl LocalSession {
    /// Connects to the daemon's API socket and opens a framed session on it.
    pub async fn open(socket: &Path) -> io::Result<LocalSession> {
        let stream = UnixStream::connect(socket).await?;
        let (read, mut write) = stream.into_split();
        write.write_all(PREFACE).await?;
        let mut read = BufReader::new(read);
        let mut answer = [0u8; PREFACE.len()];
        read.read_exact(&mut answer).await?;
        if &answer != PREFACE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} answered the framed session's preface with {:?}, not {:?}",
                    socket.display(),
                    String::from_utf8_lossy(&answer),
                    String::from_utf8_lossy(PREFACE)
                ),
            ));
        }
        Ok(LocalSession {
            read,
            write,
            out: Vec::new(),
            body: Vec::new(),
        })
    }

    /// Queues one request's frame (sent by the next [`LocalSession::flush`]).
    pub fn queue(&mut self, req: &SessionRequest) {
        put_frame(&mut self.out, req).expect("a Vec grows to take any message");
    }

    /// Writes the queued frames (one write when the socket takes them).
    pub async fn flush(&mut self) -> io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        self.write.write_all(&self.out).await?;
        self.out.clear();
        Ok(())
    }

    /// The next event; `None` when the daemon ended the session (end of stream between frames).
    pub async fn next(&mut self) -> io::Result<Option<SessionEvent>> {
        let mut head = [0u8; 4];
        match self.read.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let len = u32::from_be_bytes(head) as usize;
        if len > MAX_FRAME {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("an event frame of {len} bytes, over the {MAX_FRAME}-byte limit"),
            ));
        }
        self.body.resize(len, 0);
        self.read.read_exact(&mut self.body).await?;
        SessionEvent::decode(self.body.as_slice())
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("an event frame: {e}")))
    }

    /// Half-closes the request side: the daemon ends the session once every open request has
    /// had its event.
    pub async fn close(&mut self) -> io::Result<()> {
        self.flush().await?;
        self.write.shutdown().await
    }
}
