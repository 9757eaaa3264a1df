//! Reading the Prometheus endpoint in tests: a plain HTTP/1.0 GET, its samples, sums over labels.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// GET `path` over plain HTTP/1.0: (status line, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("metrics endpoint connects");
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8(raw).expect("UTF-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("headers end");
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// Sample lines as `name{labels}` -> value.
pub fn samples(body: &str) -> BTreeMap<String, f64> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The sum of every sample of `name` whose labels include all of `labels`.
pub fn sum(s: &BTreeMap<String, f64>, name: &str, labels: &[&str]) -> f64 {
    s.iter()
        .filter(|(k, _)| k.split('{').next() == Some(name))
        .filter(|(k, _)| labels.iter().all(|l| k.contains(l)))
        .map(|(_, v)| v)
        .sum()
}
