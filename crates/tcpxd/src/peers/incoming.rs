//! The peer port's accept path when direct control connections are on: each connection's first
//! 8 bytes tell a direct control connection ([`super::direct::PREFACE`]) from gRPC (an HTTP/2
//! client preface); gRPC connections go on to tonic with those bytes replayed in front. One port
//! for both: a firewall that lets the peer service through lets the direct connections through.
//! The accept loop is [`crate::sniffing`]'s, shared with the API unix socket.

use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::direct::{DirectAcceptor, PREFACE};
use crate::sniffing::{GrpcIncoming, Sniffing};

/// The peer port's gRPC connections, for `serve_with_incoming_shutdown`.
pub type PeerIncoming = GrpcIncoming<TcpStream>;

/// Accepts on the peer port until `stop`: direct control connections go to `direct`, gRPC ones
/// come out of the returned stream. The future ends once accepting stopped and every sniffing
/// task ended.
pub fn listen(
    listener: TcpListener,
    direct: Arc<DirectAcceptor>,
    stop: watch::Receiver<bool>,
) -> (PeerIncoming, impl Future<Output = ()> + Send + 'static) {
    let serve = move |stream, from| {
        let direct = direct.clone();
        async move { direct.accept(stream, from).await }
    };
    let sniffing = Sniffing {
        what: "the peer port",
        preface: PREFACE,
        serve,
    };
    crate::sniffing::listen(listener, sniffing, stop)
}
