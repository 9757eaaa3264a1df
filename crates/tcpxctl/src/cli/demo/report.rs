//! What a successful demo measured: the report (text and JSON) and the Prometheus scrape of
//! each daemon after the transfers.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};

use super::{DaemonExit, DemoError, ReadyInfo};
use crate::client::{format_bytes, format_duration, format_rate};

/// What the demo read from a daemon's Prometheus endpoint after the transfers.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsScrape {
    pub node_id: String,
    pub url: String,
    /// Sums over `tcpxd_transfers_total{status="ok"}` and `tcpxd_transfer_bytes_total{status="ok"}`.
    pub transfers_ok: f64,
    pub bytes_ok: f64,
}

/// Reads `http://addr/metrics` (plain HTTP/1.0, the daemon's own listener) and sums the
/// successful transfers and their bytes.
pub async fn scrape_metrics(node_id: &str, addr: &str) -> Result<MetricsScrape, DemoError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let url = format!("http://{addr}/metrics");
    let io = |what: &str| {
        let what = format!("{what} {url}");
        move |source| DemoError::Io { what, source }
    };
    let fetch = async {
        let mut s = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(io("connecting to"))?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .await
            .map_err(io("asking"))?;
        let mut body = String::new();
        s.read_to_string(&mut body).await.map_err(io("reading"))?;
        Ok::<_, DemoError>(body)
    };
    let body = tokio::time::timeout(Duration::from_secs(10), fetch)
        .await
        .map_err(|_| DemoError::BadOption(format!("{url} did not answer within 10 s")))??;
    if !body.starts_with("HTTP/1.") || !body.lines().next().is_some_and(|l| l.contains(" 200")) {
        return Err(DemoError::BadOption(format!(
            "{url} answered {:?}",
            body.lines().next().unwrap_or("")
        )));
    }
    let sum = |family: &str| -> f64 {
        body.lines()
            .filter(|l| {
                l.starts_with(family) && l[family.len()..].starts_with('{') && l.contains("status=\"ok\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .fold(0.0, |a, b| a + b)
    };
    Ok(MetricsScrape {
        node_id: node_id.to_string(),
        url,
        transfers_ok: sum("tcpxd_transfers_total"),
        bytes_ok: sum("tcpxd_transfer_bytes_total"),
    })
}

/// What a successful demo measured.
#[derive(Debug, Clone)]
pub struct DemoReport {
    pub size: u64,
    pub nodes: [ReadyInfo; 2],
    /// The WRITE A → B (the daemon's elapsed time when it reports one).
    pub write_time: Duration,
    /// The READ B → A.
    pub read_time: Duration,
    pub write_transfer_id: u64,
    pub read_transfer_id: u64,
    /// CRC-32C of A's source, B's destination and A's read-back buffer (all equal).
    pub crc32c: u32,
    /// The directory, if it was kept.
    pub kept_dir: Option<PathBuf>,
    /// How the daemons stopped.
    pub daemon_exits: Vec<DaemonExit>,
    /// Each daemon's Prometheus endpoint, scraped after the transfers.
    pub metrics: Vec<MetricsScrape>,
}

impl DemoReport {
    pub fn to_json(&self) -> Value {
        let secs = |d: Duration| d.as_secs_f64();
        let rate = |d: Duration| {
            if d.is_zero() {
                Value::Null
            } else {
                json!(self.size as f64 / d.as_secs_f64())
            }
        };
        json!({
            "size": self.size,
            "nodes": self.nodes.iter().map(|n| json!({
                "node_id": n.node_id,
                "api_socket": n.api_socket,
                "peer_address": n.peer_address,
            })).collect::<Vec<_>>(),
            "write": {
                "transfer_id": self.write_transfer_id,
                "seconds": secs(self.write_time),
                "bytes_per_second": rate(self.write_time),
            },
            "read": {
                "transfer_id": self.read_transfer_id,
                "seconds": secs(self.read_time),
                "bytes_per_second": rate(self.read_time),
            },
            "crc32c": format!("{:08x}", self.crc32c),
            "checksums_match": true,
            "kept_dir": self.kept_dir.as_ref().map(|d| d.display().to_string()),
            "metrics": self.metrics.iter().map(|m| json!({
                "node_id": m.node_id,
                "url": m.url,
                "transfers_ok": m.transfers_ok,
                "bytes_ok": m.bytes_ok,
            })).collect::<Vec<_>>(),
            "daemons": self.daemon_exits.iter().map(|e| json!({
                "node_id": e.node,
                "exit": e.describe(),
                "clean": e.clean(),
            })).collect::<Vec<_>>(),
        })
    }
}

impl std::fmt::Display for DemoReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b] = &self.nodes;
        writeln!(
            f,
            "moved {} ({} bytes) each way between {} and {} over the emulation plugin",
            format_bytes(self.size),
            self.size,
            a.node_id,
            b.node_id
        )?;
        writeln!(
            f,
            "  write {} -> {}  {:>10}  {:>10}",
            a.node_id,
            b.node_id,
            format_duration(self.write_time),
            format_rate(self.size, self.write_time)
        )?;
        writeln!(
            f,
            "  read  {} -> {}  {:>10}  {:>10}",
            b.node_id,
            a.node_id,
            format_duration(self.read_time),
            format_rate(self.size, self.read_time)
        )?;
        for m in &self.metrics {
            writeln!(
                f,
                "  metrics {} ({}): {} transfers ok, {} bytes",
                m.url, m.node_id, m.transfers_ok, m.bytes_ok
            )?;
        }
        write!(f, "  crc32c {:08x}: checksums match", self.crc32c)?;
        if let Some(dir) = &self.kept_dir {
            write!(f, "\n  kept {}", dir.display())?;
        }
        Ok(())
    }
}
