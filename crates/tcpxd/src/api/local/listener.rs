//! The API unix socket's accept path: each connection's first 8 bytes tell the framed local
//! session (`TCPXD/1\n`) from gRPC (an HTTP/2 client preface); gRPC connections go on to tonic
//! with those bytes replayed in front.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::TaskTracker;
use tonic::transport::server::{Connected, UdsConnectInfo};

use super::frame::PREFACE;
use crate::api::state::DaemonState;

/// How long a new connection has to send its first 8 bytes.
pub const PREFACE_WAIT: Duration = Duration::from_secs(10);

/// gRPC connections sniffed but not yet taken by tonic.
const HANDOFF_QUEUE: usize = 64;

/// The gRPC connections of the API socket, for `serve_with_incoming_shutdown`.
pub type GrpcIncoming = ReceiverStream<io::Result<Rewound>>;

/// Accepts on the API unix socket until `stop`: framed sessions are served here, gRPC
/// connections come out of the returned stream. The returned future ends once accepting has
/// stopped and every connection task of this listener has ended (framed sessions drain as the
/// `Session` RPC does).
pub fn listen(
    listener: UnixListener,
    state: Arc<DaemonState>,
    stop: watch::Receiver<bool>,
) -> (GrpcIncoming, impl Future<Output = ()> + Send + 'static) {
    let (tx, rx) = mpsc::channel(HANDOFF_QUEUE);
    (ReceiverStream::new(rx), accept(listener, state, stop, tx))
}

async fn accept(
    listener: UnixListener,
    state: Arc<DaemonState>,
    mut stop: watch::Receiver<bool>,
    grpc: mpsc::Sender<io::Result<Rewound>>,
) {
    let tasks = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                tasks.spawn(sniff(stream, state.clone(), stop.clone(), grpc.clone()));
            }
            Err(e) => {
                // Out of descriptors and the like: the error stands until something closes.
                tracing::warn!("accepting on the API socket: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    drop(grpc);
    tasks.close();
    tasks.wait().await;
}

/// Reads a connection's first 8 bytes (at most `PREFACE_WAIT`) and hands it on.
async fn sniff(
    mut stream: UnixStream,
    state: Arc<DaemonState>,
    mut stop: watch::Receiver<bool>,
    grpc: mpsc::Sender<io::Result<Rewound>>,
) {
    let mut head = [0u8; 8];
    let read = tokio::select! {
        _ = stop.wait_for(|s| *s) => return,
        read = tokio::time::timeout(PREFACE_WAIT, stream.read_exact(&mut head)) => read,
    };
    match read {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::debug!("API connection closed before its first 8 bytes: {e}");
            return;
        }
        Err(_) => {
            tracing::debug!("closing an API connection that sent fewer than 8 bytes in {PREFACE_WAIT:?}");
            return;
        }
    }
    if &head == PREFACE {
        super::serve(state, stream).await;
    } else if grpc.send(Ok(Rewound::new(head, stream))).await.is_err() {
        tracing::debug!("API connection dropped: the gRPC server has stopped");
    }
}

/// A connection whose first bytes were read already: reads give them back first.
#[derive(Debug)]
pub struct Rewound {
    head: [u8; 8],
    /// How many of `head` reads have given back.
    given: usize,
    io: UnixStream,
}

impl Rewound {
    fn new(head: [u8; 8], io: UnixStream) -> Rewound {
        Rewound { head, given: 0, io }
    }
}

impl AsyncRead for Rewound {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.given < this.head.len() {
            let n = buf.remaining().min(this.head.len() - this.given);
            buf.put_slice(&this.head[this.given..this.given + n]);
            this.given += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewound {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl Connected for Rewound {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> UdsConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn a_rewound_connection_reads_its_head_then_the_rest() {
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(b" the rest").await.unwrap();
        drop(b);
        let mut r = Rewound::new(*b"PRI * HT", a);
        let mut small = [0u8; 3];
        r.read_exact(&mut small).await.unwrap();
        assert_eq!(&small, b"PRI");
        let mut all = Vec::new();
        r.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b" * HT the rest");
    }
}
