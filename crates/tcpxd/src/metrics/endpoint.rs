//! The `GET /metrics` endpoint (HTTP/1 over hyper).

use std::net::SocketAddr;
use std::time::Duration;

/// Serves `GET /metrics` on `addr` until `stop` turns true. `render` makes the page.
pub async fn serve<F, Fut>(
    listener: tokio::net::TcpListener,
    render: F,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<String, String>> + Send,
{
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::{Method, Response, StatusCode};

    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.wait_for(|s| *s) => return,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!("metrics listener: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let render = render.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let render = render.clone();
                async move {
                    let reply = |status: StatusCode, ctype: &str, body: String| {
                        Response::builder()
                            .status(status)
                            .header("content-type", ctype)
                            .body(Full::new(Bytes::from(body)))
                    };
                    match (req.method(), req.uri().path()) {
                        (&Method::GET, "/metrics") => match render().await {
                            Ok(text) => reply(StatusCode::OK, prometheus::TEXT_FORMAT, text),
                            Err(e) => reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", e + "\n"),
                        },
                        (&Method::GET, "/") => reply(
                            StatusCode::OK,
                            "text/plain",
                            "tcpxd: metrics at /metrics\n".into(),
                        ),
                        _ => reply(
                            StatusCode::NOT_FOUND,
                            "text/plain",
                            "not found: GET /metrics\n".into(),
                        ),
                    }
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            // A client that never finishes its request headers is dropped.
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(io, svc)
                .await
            {
                tracing::debug!("metrics connection: {e}");
            }
        });
    }
}

/// Binds the metrics listener (so a bad address fails the daemon's start, not a later task).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
