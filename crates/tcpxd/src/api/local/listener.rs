//! The API unix socket's accept path: each connection's first 8 bytes tell the framed local
//! session (`TCPXD/1\n`) from gRPC (an HTTP/2 client preface); gRPC connections go on to tonic
//! with those bytes replayed in front.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::TaskTracker;

use super::frame::PREFACE;
use crate::api::state::DaemonState;
use crate::rewound::Rewound;

/// How long a new connection has to send its first 8 bytes.
pub const PREFACE_WAIT: Duration = Duration::from_secs(10);

/// gRPC connections sniffed but not yet taken by tonic.
const HANDOFF_QUEUE: usize = 64;

/// The gRPC connections of the API socket, for `serve_with_incoming_shutdown`.
pub type GrpcIncoming = ReceiverStream<io::Result<Rewound<UnixStream>>>;

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
    grpc: mpsc::Sender<io::Result<Rewound<UnixStream>>>,
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
    grpc: mpsc::Sender<io::Result<Rewound<UnixStream>>>,
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
