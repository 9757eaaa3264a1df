//! One listener, two protocols: the accept loop shared by the API unix socket
//! (`api::local::listener`: the framed local session beside gRPC) and the peer port
//! (`peers::incoming`: direct control connections beside gRPC). Each connection's first 8 bytes
//! are read (at most [`PREFACE_WAIT`]): the listener's own preface hands the connection to its
//! handler, anything else (an HTTP/2 client preface) goes on to tonic with those bytes replayed
//! in front ([`Rewound`]).

use std::fmt::Debug;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::TaskTracker;

use crate::rewound::Rewound;

/// How long a new connection has to send its first 8 bytes.
pub const PREFACE_WAIT: Duration = Duration::from_secs(10);

/// gRPC connections sniffed but not yet taken by tonic.
const HANDOFF_QUEUE: usize = 64;

/// How long the loop waits after a failed accept (out of descriptors and the like: the error
/// stands until something closes).
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// A listener the loop accepts on: tokio's TCP and unix listeners.
pub trait Accepting: Send + 'static {
    type Stream: AsyncRead + Unpin + Send + 'static;
    /// Where a connection came from (for the logs).
    type From: Debug + Send + 'static;
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, Self::From)>> + Send;
}

impl Accepting for TcpListener {
    type Stream = TcpStream;
    type From = SocketAddr;

    async fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        let (stream, from) = TcpListener::accept(self).await?;
        // Without it a small message written while the previous one is unacknowledged waits
        // for the peer's delayed ACK (40 ms on Linux).
        let _ = stream.set_nodelay(true);
        Ok((stream, from))
    }
}

impl Accepting for UnixListener {
    type Stream = UnixStream;
    type From = tokio::net::unix::SocketAddr;

    fn accept(&self) -> impl Future<Output = io::Result<(UnixStream, Self::From)>> + Send {
        UnixListener::accept(self)
    }
}

/// A listener's gRPC connections, for `serve_with_incoming_shutdown`.
pub type GrpcIncoming<S> = ReceiverStream<io::Result<Rewound<S>>>;

/// What the loop needs besides the listener: its name in the logs (`"the API socket"`), the
/// preface of its own protocol, and what serves a connection that sent it.
pub struct Sniffing<H> {
    pub what: &'static str,
    pub preface: &'static [u8; 8],
    pub serve: H,
}

/// Accepts on `listener` until `stop`: connections that start with `sniffing.preface` go to
/// `sniffing.serve`, the others come out of the returned stream. The returned future ends once
/// accepting has stopped and every connection task of this listener has ended (a served
/// connection ends as its handler decides).
pub fn listen<L, H, F>(
    listener: L,
    sniffing: Sniffing<H>,
    stop: watch::Receiver<bool>,
) -> (GrpcIncoming<L::Stream>, impl Future<Output = ()> + Send + 'static)
where
    L: Accepting + Sync,
    H: Fn(L::Stream, L::From) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(HANDOFF_QUEUE);
    (
        ReceiverStream::new(rx),
        accept(listener, Arc::new(sniffing), stop, tx),
    )
}

async fn accept<L, H, F>(
    listener: L,
    sniffing: Arc<Sniffing<H>>,
    mut stop: watch::Receiver<bool>,
    grpc: mpsc::Sender<io::Result<Rewound<L::Stream>>>,
) where
    L: Accepting + Sync,
    H: Fn(L::Stream, L::From) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let tasks = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, from)) => {
                tasks.spawn(sniff(stream, from, sniffing.clone(), stop.clone(), grpc.clone()));
            }
            Err(e) => {
                tracing::warn!("accepting on {}: {e}", sniffing.what);
                tokio::time::sleep(ACCEPT_RETRY).await;
            }
        }
    }
    drop(grpc);
    tasks.close();
    tasks.wait().await;
}

/// Reads a connection's first 8 bytes (at most `PREFACE_WAIT`) and hands it on.
async fn sniff<S, A, H, F>(
    mut stream: S,
    from: A,
    sniffing: Arc<Sniffing<H>>,
    mut stop: watch::Receiver<bool>,
    grpc: mpsc::Sender<io::Result<Rewound<S>>>,
) where
    S: AsyncRead + Unpin,
    A: Debug,
    H: Fn(S, A) -> F,
    F: Future<Output = ()>,
{
    let what = sniffing.what;
    let mut head = [0u8; 8];
    let read = tokio::select! {
        _ = stop.wait_for(|s| *s) => return,
        read = tokio::time::timeout(PREFACE_WAIT, stream.read_exact(&mut head)) => read,
    };
    match read {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::debug!(
                ?from,
                "a connection to {what} closed before its first 8 bytes: {e}"
            );
            return;
        }
        Err(_) => {
            tracing::debug!(
                ?from,
                "closing a connection to {what} that sent fewer than 8 bytes in {PREFACE_WAIT:?}"
            );
            return;
        }
    }
    if &head == sniffing.preface {
        (sniffing.serve)(stream, from).await;
    } else if grpc.send(Ok(Rewound::new(head, stream))).await.is_err() {
        tracing::debug!(
            ?from,
            "a connection to {what} dropped: its gRPC server has stopped"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio_stream::StreamExt;

    const OURS: &[u8; 8] = b"TEST/1\n\0";

    /// A listener whose own connections answer "ours:" and the first byte after the preface.
    fn start<L: Accepting + Sync>(
        listener: L,
    ) -> (
        GrpcIncoming<L::Stream>,
        tokio::task::JoinHandle<()>,
        watch::Sender<bool>,
    )
    where
        L::Stream: tokio::io::AsyncWrite,
    {
        let (stop_tx, stop) = watch::channel(false);
        let serve = |mut s: L::Stream, _from: L::From| async move {
            let mut b = [0u8; 1];
            s.read_exact(&mut b).await.unwrap();
            s.write_all(&[b"ours:".as_slice(), &b].concat()).await.unwrap();
        };
        let sniffing = Sniffing {
            what: "the test listener",
            preface: OURS,
            serve,
        };
        let (incoming, accepting) = listen(listener, sniffing, stop);
        (incoming, tokio::spawn(accepting), stop_tx)
    }

    /// Our preface is served here; an HTTP/2 preface comes out whole; a silent connection
    /// does not hold the stop back; stopping ends the loop and the stream.
    async fn both_protocols<L, C, Fut>(listener: L, connect: C)
    where
        L: Accepting + Sync,
        L::Stream: tokio::io::AsyncWrite,
        C: Fn() -> Fut,
        Fut: Future<Output = L::Stream>,
    {
        let (mut incoming, accepting, stop) = start(listener);

        let mut ours = connect().await;
        ours.write_all(OURS).await.unwrap();
        ours.write_all(b"x").await.unwrap();
        let mut answer = Vec::new();
        ours.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"ours:x");

        let mut grpc = connect().await;
        grpc.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        let mut handed = incoming.next().await.unwrap().unwrap();
        let mut head = [0u8; 16];
        handed.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"PRI * HTTP/2.0\r\n");

        let _silent = connect().await;
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(30), accepting)
            .await
            .expect("the loop ends at stop, a silent connection or not")
            .unwrap();
        assert!(incoming.next().await.is_none(), "the stream ends with the loop");
    }

    #[tokio::test]
    async fn unix_listener_tells_the_protocols_apart() {
        let path = std::env::temp_dir().join(format!("tcpxd-sniffing-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let to = path.clone();
        both_protocols(listener, || {
            let to = to.clone();
            async move { UnixStream::connect(to).await.unwrap() }
        })
        .await;
        let _ = std::fs::remove_file(&path);
    }

    #[tokio::test]
    async fn tcp_listener_tells_the_protocols_apart() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        both_protocols(
            listener,
            || async move { TcpStream::connect(addr).await.unwrap() },
        )
        .await;
    }
}
