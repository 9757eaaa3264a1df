//! A connection whose first bytes were read already, to tell two protocols on one listener apart
//! (the local API socket's framed session from gRPC, `api::local::listener`; the peer port's
//! direct control connections from gRPC, `peers::incoming`): reads give those bytes back first,
//! so tonic sees the connection whole.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// `io` with `head` (read already) in front of what it reads next.
#[derive(Debug)]
pub struct Rewound<S> {
    head: [u8; 8],
    /// How many of `head` reads have given back.
    given: usize,
    io: S,
}

impl<S> Rewound<S> {
    pub fn new(head: [u8; 8], io: S) -> Rewound<S> {
        Rewound { head, given: 0, io }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewound<S> {
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

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewound<S> {
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

impl<S: Connected> Connected for Rewound<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> S::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixStream;

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
