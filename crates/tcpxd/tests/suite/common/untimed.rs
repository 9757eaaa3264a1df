//! A gRPC client that sends a call's `grpc-timeout` to the daemon without keeping that deadline
//! itself. tonic's channel ends a call when its `grpc-timeout` passes (its `GrpcTimeout` layer),
//! so a test of what the daemon answers just before a deadline (ReleaseBuffer's
//! FAILED_PRECONDITION, up to 50 ms before it) raced the client's own timer: on a loaded machine
//! the client gave up first, with CANCELLED "Timeout expired". This one speaks HTTP/2 to the
//! daemon's unix socket through hyper, with no timer: the daemon's answer is what comes back.

use std::path::Path;

use hyper_util::rt::{TokioExecutor, TokioIo};
use tcpxd::api::proto::v1::tcpxd_client::TcpxdClient;
use tonic::codegen::http;

type Call = http::Request<tonic::body::Body>;
type Answer = http::Response<hyper::body::Incoming>;

/// The service under [`UntimedClient`]: one HTTP/2 connection.
pub type Untimed = tower::util::BoxCloneService<Call, Answer, hyper::Error>;
pub type UntimedClient = TcpxdClient<Untimed>;

/// A client of the daemon whose API listens on `socket`.
pub async fn client(socket: &Path) -> UntimedClient {
    let io = TokioIo::new(
        tokio::net::UnixStream::connect(socket)
            .await
            .expect("the API socket"),
    );
    let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .expect("an HTTP/2 connection");
    tokio::spawn(conn);
    let svc = tower::service_fn(move |call: Call| {
        let mut send = send.clone();
        async move { send.send_request(call).await }
    });
    TcpxdClient::with_origin(
        tower::util::BoxCloneService::new(svc),
        http::Uri::from_static("http://tcpxd"),
    )
}
