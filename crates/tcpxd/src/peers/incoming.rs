//! The peer port's accept path when direct control connections are on: each connection's first
//! 8 bytes tell a direct control connection ([`super::direct::PREFACE`]) from gRPC (an HTTP/2
//! client preface); gRPC connections go on to tonic with those bytes replayed in front. One port
//! for both: a firewall that lets the peer service through lets the direct connections through.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::TaskTracker;

use super::direct::{DirectAcceptor, PREFACE};
use crate::rewound::Rewound;

/// How long a new connection has to send its first 8 bytes.
const PREFACE_WAIT: Duration = Duration::from_secs(10);
/// gRPC connections sniffed but not yet taken by tonic.
const HANDOFF_QUEUE: usize = 64;

/// The peer port's gRPC connections, for `serve_with_incoming_shutdown`.
pub type PeerIncoming = ReceiverStream<io::Result<Rewound<TcpStream>>>;

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
    grpc: mpsc::Sender<io::Result<Rewound<TcpStream>>>,
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
    grpc: mpsc::Sender<io::Result<Rewound<TcpStream>>>,
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
    } else if grpc.send(Ok(Rewound::new(head, stream))).await.is_err() {
        tracing::debug!("peer connection dropped: the peer service has stopped");
    }
}
