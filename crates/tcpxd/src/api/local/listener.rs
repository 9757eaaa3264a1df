//! The API unix socket's accept path: each connection's first 8 bytes tell the framed local
//! session (`TCPXD/1\n`) from gRPC (an HTTP/2 client preface); gRPC connections go on to tonic
//! with those bytes replayed in front. The accept loop is [`crate::sniffing`]'s, shared with the
//! peer port.

use std::sync::Arc;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

use super::frame::PREFACE;
use crate::api::state::DaemonState;
use crate::sniffing::Sniffing;

/// The gRPC connections of the API socket, for `serve_with_incoming_shutdown`.
pub type GrpcIncoming = crate::sniffing::GrpcIncoming<UnixStream>;

/// Accepts on the API unix socket until `stop`: framed sessions are served here, gRPC
/// connections come out of the returned stream. The returned future ends once accepting has
/// stopped and every connection task of this listener has ended (framed sessions drain as the
/// `Session` RPC does).
pub fn listen(
    listener: UnixListener,
    state: Arc<DaemonState>,
    stop: watch::Receiver<bool>,
) -> (GrpcIncoming, impl Future<Output = ()> + Send + 'static) {
    let serve = move |stream, _from| super::serve(state.clone(), stream);
    let sniffing = Sniffing {
        what: "the API socket",
        preface: PREFACE,
        serve,
    };
    crate::sniffing::listen(listener, sniffing, stop)
}
