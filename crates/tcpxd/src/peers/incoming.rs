//! The peer port's accept path when direct control connections are on: each connection's first
//! 8 bytes tell a direct control connection ([`super::direct::PREFACE`]) from gRPC (an HTTP/2
//! client preface); gRPC connections go on to tonic with those bytes replayed in front. One port
//! for both: a firewall that lets the peer service through lets the direct connections through.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::TaskTracker;
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::direct::{DirectAcceptor, PREFACE};

/// How long a new connection has to send its first 8 bytes.
const PREFACE_WAIT: Duration = Duration::from_secs(10);
/// gRPC connections sniffed but not yet taken by tonic.
const HANDOFF_QUEUE: usize = 64;

/// The peer port's gRPC connections, for `serve_with_incoming_shutdown`.
pub type PeerIncoming = ReceiverStream<io::Result<Rewound>>;

/// Accepts on the peer port until `stop`: direct control connections go to `direct`, gRPC ones
/// come out of the returned stream. The future ends once accepting stopped and every sniffing
/// task ended.
pub fn listen(
    listener: TcpListener,
    direct: Arc<DirectAcceptor>,
    stop: watch::Receiver<bool>,
) -> (PeerIncoming, impl Future<Output = ()> + Send + 'static) {
    let (tx, rx) = mpsc::channel(HANDOFF_QUEUE);
    (ReceiverStream::new(rx), accept(listener, direct, stop, tx))
}

async fn accept(
    listener: TcpListener,
    direct: Arc<DirectAcceptor>,
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
            Ok((stream, from)) => {
                // Without it a small message written while the previous one is unacknowledged
                // waits for the peer's delayed ACK (40 ms on Linux).
                let _ = stream.set_nodelay(true);
                tasks.spawn(sniff(stream, from, direct.clone(), stop.clone(), grpc.clone()));
            }
            Err(e) => {
                tracing::warn!("accepting on the peer port: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    drop(grpc);
    tasks.close();
    tasks.wait().await;
}

async fn sniff(
    mut stream: TcpStream,
    from: std::net::SocketAddr,
    direct: Arc<DirectAcceptor>,
    mut stop: watch::Receiver<bool>,
    grpc: mpsc::Sender<io::Result<Rewound>>,
) {
    let mut head = [0u8; 8];
    let read = tokio::select! {
        _ = stop.wait_for(|s| *s) => return,
        read = tokio::time::timeout(PREFACE_WAIT, stream.read_exact(&mut head)) => read,
    };
    if !matches!(read, Ok(Ok(_))) {
        tracing::debug!(%from, "peer connection closed or silent before its first 8 bytes");
        return;
    }
    if &head == PREFACE {
        direct.accept(stream, from).await;
    } else if grpc
        .send(Ok(Rewound {
            head,
            given: 0,
            io: stream,
        }))
        .await
        .is_err()
    {
        tracing::debug!("peer connection dropped: the peer service has stopped");
    }
}

/// A connection whose first bytes were read already: reads give them back first.
#[derive(Debug)]
pub struct Rewound {
    head: [u8; 8],
    given: usize,
    io: TcpStream,
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
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.io.connect_info()
    }
}
