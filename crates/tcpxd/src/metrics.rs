//! Prometheus metrics: one registry per daemon (tests run several in one process).
//!
//! Two kinds of series:
//! - events the poller records as they happen ([`Metrics`] and the poller-side [`Meter`]):
//!   transfers and bytes by op and status, latency per size class, unpack time, time from a
//!   receive's completion to its consumption, plugin errors by code;
//! - state read from the poller's stats snapshot at each scrape ([`Metrics::render`]): per-lane
//!   bytes, chunks, requests in flight, queued chunks and window-full events, and peer states.
//!
//! The `GetStats` RPC reads the same objects ([`Metrics::summary`]), so `tcpxctl stats` and a
//! scrape agree. docs/OPERATIONS.md lists every series.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::core::{Collector, Metric as _};
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

use crate::engine::{Code, Outcome, TransferId};
use crate::net::NetError;
use crate::peer_stats::{PeerLink, StatsSnapshot};

/// Which way a transfer moves data, from the initiator's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Write,
    Read,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
        }
    }
}

/// The `size_class` label of a transfer of `bytes`.
pub fn size_class(bytes: u64) -> &'static str {
    match bytes {
        b if b < 64 << 10 => "lt_64k",
        b if b < 1 << 20 => "64k_1m",
        b if b < 16 << 20 => "1m_16m",
        b if b < 256 << 20 => "16m_256m",
        _ => "ge_256m",
    }
}

/// The `status` label of an outcome code.
pub fn status_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
    }
}

/// Every outcome code, for the series exported from 0.
const ALL_CODES: [Code; 12] = [
    Code::Ok,
    Code::Cancelled,
    Code::InvalidArgument,
    Code::DeadlineExceeded,
    Code::NotFound,
    Code::AlreadyExists,
    Code::PermissionDenied,
    Code::ResourceExhausted,
    Code::FailedPrecondition,
    Code::Aborted,
    Code::Internal,
    Code::Unavailable,
];

/// The `code` labels of `tcpxd_plugin_errors_total`: the ncclResult_t errors, a timeout, other.
const PLUGIN_ERROR_CODES: [&str; 8] = [
    "ncclUnhandledCudaError",
    "ncclSystemError",
    "ncclInternalError",
    "ncclInvalidArgument",
    "ncclInvalidUsage",
    "ncclRemoteError",
    "timeout",
    "other",
];

/// Transfer latency buckets, seconds: 100 µs to ~100 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 100.0,
];
/// Per-chunk buckets, seconds: 1 µs to 1 s.
const CHUNK_BUCKETS: &[f64] = &[
    0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.1, 1.0,
];

/// What a scrape reads besides the poller's snapshot.
#[derive(Debug, Clone, Default)]
pub struct NodeGauges {
    /// Registered buffers, and their bytes.
    pub buffers: usize,
    pub buffer_bytes: u64,
    /// The host memory a registration may still fault in (`crate::headroom::available`;
    /// `None`: unreadable, and the series is left out), and the reserve kept free.
    pub memory_available: Option<u64>,
    pub memory_reserve: u64,
}

/// The event series of one daemon.
pub struct Metrics {
    registry: Registry,
    transfers: IntCounterVec,
    bytes: IntCounterVec,
    latency: HistogramVec,
    unpack: HistogramVec,
    recv_to_consume: Histogram,
    plugin_errors: IntCounterVec,
    reattached: IntCounterVec,
    reattach_forgotten: prometheus::IntCounter,
    reattach_pending: prometheus::IntGauge,
    stale_rx_rules: prometheus::IntCounter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("registered once");
    c
}

fn histogram_vec(r: &Registry, name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), labels)
        .expect("valid metric");
    r.register(Box::new(h.clone())).expect("registered once");
    h
}

impl Metrics {
    pub fn new() -> Metrics {
        let r = Registry::new();
        let m = Metrics {
            transfers: counter_vec(
                &r,
                "tcpxd_transfers_total",
                "Transfers this node started that finished, by op and status",
                &["op", "status"],
            ),
            bytes: counter_vec(
                &r,
                "tcpxd_transfer_bytes_total",
                "Bytes moved by finished transfers this node started, by op and status",
                &["op", "status"],
            ),
            latency: histogram_vec(
                &r,
                "tcpxd_transfer_duration_seconds",
                "Time from request to completion of successful transfers, by op and size class",
                &["op", "size_class"],
                LATENCY_BUCKETS,
            ),
            unpack: histogram_vec(
                &r,
                "tcpxd_unpack_seconds",
                "Time from a receive's completion to its data being in place (unpacked), by kind",
                &["kind"],
                CHUNK_BUCKETS,
            ),
            recv_to_consume: {
                let h = Histogram::with_opts(
                    HistogramOpts::new(
                        "tcpxd_recv_to_consume_seconds",
                        "Time from a receive's completion to irecvConsumed returning its pages",
                    )
                    .buckets(CHUNK_BUCKETS.to_vec()),
                )
                .expect("valid metric");
                r.register(Box::new(h.clone())).expect("registered once");
                h
            },
            plugin_errors: counter_vec(
                &r,
                "tcpxd_plugin_errors_total",
                "Errors from the net plugin's data path, by ncclResult_t code",
                &["code"],
            ),
            reattached: counter_vec(
                &r,
                "tcpxd_reattached_total",
                "Registrations of the previous instance taken back after a restart, by kind (buffer, block_list, prepared_list: by their clients; host_restored, cuda_restored: daemon-allocated host and CUDA memory, by the daemon)",
                &["kind"],
            ),
            reattach_forgotten: {
                let c = prometheus::IntCounter::new(
                    "tcpxd_reattach_forgotten_total",
                    "Registrations of the previous instance no client re-attached within runtime.reattach_grace_s",
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("registered once");
                c
            },
            stale_rx_rules: {
                let c = prometheus::IntCounter::new(
                    "tcpxd_stale_rx_rules_removed_total",
                    "Flow-steering rules a previous instance left in RxDM (it died with receive comms open), removed at start-up",
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("registered once");
                c
            },
            reattach_pending: {
                let g = prometheus::IntGauge::new(
                    "tcpxd_reattach_pending",
                    "Registrations of the previous instance still waiting for their clients to re-attach them",
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("registered once");
                g
            },
            registry: {
                // When this daemon instance started: a restart shows as a new value (dashboards:
                // changes(); alerts: a daemon restarting). Per daemon, not per process: tests run
                // several in one process.
                let g = prometheus::Gauge::new(
                    "tcpxd_start_time_seconds",
                    "When this daemon instance started, in seconds since the Unix epoch",
                )
                .expect("valid metric");
                g.set(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                );
                r.register(Box::new(g)).expect("registered once");
                r
            },
        };
        // Every (op, status) and every error code from 0, so the first failure of a kind is a
        // rise a rate() sees, not a new series starting at 1 (dashboards and alerts would miss
        // it).
        for op in [Op::Write, Op::Read] {
            for code in ALL_CODES {
                m.transfers.with_label_values(&[op.as_str(), status_label(code)]);
                m.bytes.with_label_values(&[op.as_str(), status_label(code)]);
            }
        }
        for code in PLUGIN_ERROR_CODES {
            m.plugin_errors.with_label_values(&[code]);
        }
        m
    }

    /// A registration came back after a restart (`kind`: buffer, block_list, prepared_list,
    /// host_restored, cuda_restored).
    pub fn reattached(&self, kind: &str) {
        self.reattached.with_label_values(&[kind]).inc();
    }

    /// Flow-steering rules of a previous instance were removed from RxDM.
    pub fn stale_rx_rules_removed(&self, n: usize) {
        self.stale_rx_rules.inc_by(n as u64);
    }

    /// Registrations nobody re-attached were forgotten.
    pub fn reattach_forgotten(&self, n: usize) {
        self.reattach_forgotten.inc_by(n as u64);
    }

    /// Registrations still waiting to be re-attached.
    pub fn set_reattach_pending(&self, n: usize) {
        self.reattach_pending.set(n as i64);
    }

    /// A transfer this node started finished.
    pub fn transfer_finished(&self, op: Op, code: Code, bytes: u64, total: u64, took: Duration) {
        let status = status_label(code);
        self.transfers.with_label_values(&[op.as_str(), status]).inc();
        self.bytes.with_label_values(&[op.as_str(), status]).inc_by(bytes);
        if code == Code::Ok {
            self.latency
                .with_label_values(&[op.as_str(), size_class(total)])
                .observe(took.as_secs_f64());
        }
    }

    /// A receive was consumed: `unpack` after its completion its data was in place (`kind`:
    /// "host" or "gpu"), `consume` after it the plugin got its pages back.
    pub fn recv_consumed(&self, kind: &'static str, unpack: Duration, consume: Duration) {
        self.unpack
            .with_label_values(&[kind])
            .observe(unpack.as_secs_f64());
        self.recv_to_consume.observe(consume.as_secs_f64());
    }

    /// The plugin's data path returned an error.
    pub fn plugin_error(&self, e: &NetError) {
        let code = match e {
            NetError::Plugin { code, .. } => crate::net::abi::result_name(*code),
            NetError::Timeout { .. } => "timeout",
            _ => "other",
        };
        self.plugin_errors.with_label_values(&[code]).inc();
    }

    /// The Prometheus text exposition: the event series, then the snapshot's.
    pub fn render(&self, snap: &StatsSnapshot, node: &NodeGauges) -> String {
        let mut families = self.registry.gather();
        families.extend(snapshot_registry(snap, node).gather());
        families.extend(crate::net::log_limit::metric_families());
        families.sort_by(|a, b| a.name().cmp(b.name()));
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&families, &mut out)
            .expect("text encoding of valid families");
        String::from_utf8(out).expect("the text format is UTF-8")
    }

    /// The event series as the `GetStats` RPC returns them.
    pub fn summary(&self) -> Summary {
        let mut s = Summary::default();
        for m in self.transfers.collect().iter().flat_map(|f| f.get_metric()) {
            let (op, status) = (label(m, "op"), label(m, "status"));
            let e = s.transfers.entry((op, status)).or_default();
            e.0 = m.get_counter().get_value() as u64;
        }
        for m in self.bytes.collect().iter().flat_map(|f| f.get_metric()) {
            let (op, status) = (label(m, "op"), label(m, "status"));
            s.transfers.entry((op, status)).or_default().1 = m.get_counter().get_value() as u64;
        }
        for m in self.latency.collect().iter().flat_map(|f| f.get_metric()) {
            s.latency
                .insert((label(m, "op"), label(m, "size_class")), hist(m.get_histogram()));
        }
        for m in self.unpack.collect().iter().flat_map(|f| f.get_metric()) {
            s.unpack.insert(label(m, "kind"), hist(m.get_histogram()));
        }
        // Only what happened: the series exported from 0 are not listed.
        s.transfers.retain(|_, (n, _)| *n > 0);
        s.recv_to_consume = hist(self.recv_to_consume.metric().get_histogram());
        for m in self.plugin_errors.collect().iter().flat_map(|f| f.get_metric()) {
            let n = m.get_counter().get_value() as u64;
            if n > 0 {
                s.plugin_errors.insert(label(m, "code"), n);
            }
        }
        s
    }
}

fn label(m: &prometheus::proto::Metric, name: &str) -> String {
    m.get_label()
        .iter()
        .find(|l| l.name() == name)
        .map(|l| l.value().to_string())
        .unwrap_or_default()
}

fn hist(h: &prometheus::proto::Histogram) -> Hist {
    Hist {
        count: h.get_sample_count(),
        sum_seconds: h.get_sample_sum(),
        buckets: h
            .get_bucket()
            .iter()
            .map(|b| (b.upper_bound(), b.cumulative_count()))
            .collect(),
    }
}

/// A histogram's state: cumulative counts per upper bound (seconds), as Prometheus has it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hist {
    pub count: u64,
    pub sum_seconds: f64,
    pub buckets: Vec<(f64, u64)>,
}

/// The event series, keyed by their labels.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// (op, status) -> (transfers, bytes).
    pub transfers: BTreeMap<(String, String), (u64, u64)>,
    /// (op, size class) -> latency.
    pub latency: BTreeMap<(String, String), Hist>,
    /// kind -> unpack time.
    pub unpack: BTreeMap<String, Hist>,
    pub recv_to_consume: Hist,
    /// code -> count.
    pub plugin_errors: BTreeMap<String, u64>,
}

impl Summary {
    /// Transfers this node started that finished: (ok, any other status), over every op.
    pub fn ok_and_failed(&self) -> (u64, u64) {
        self.transfers
            .iter()
            .fold((0, 0), |(ok, failed), ((_, status), (n, _))| {
                if status == "ok" {
                    (ok + n, failed)
                } else {
                    (ok, failed + n)
                }
            })
    }
}

/// The snapshot's series, made fresh for one scrape (peers with one node id summed).
fn snapshot_registry(snap: &StatsSnapshot, node: &NodeGauges) -> Registry {
    let r = Registry::new();
    let lane_labels = &["peer", "lane", "direction"];
    let lane_bytes = counter_vec(
        &r,
        "tcpxd_lane_bytes_total",
        "Payload bytes moved on a lane (every transfer, either side's)",
        lane_labels,
    );
    let lane_chunks = counter_vec(
        &r,
        "tcpxd_lane_chunks_total",
        "Chunks moved on a lane",
        lane_labels,
    );
    let window_full = counter_vec(
        &r,
        "tcpxd_lane_window_full_total",
        "Times a lane's window filled with chunks still waiting for a slot",
        lane_labels,
    );
    let gauge = |name: &str, help: &str, labels: &[&str]| {
        let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
        r.register(Box::new(g.clone())).expect("registered once");
        g
    };
    let in_flight = gauge(
        "tcpxd_lane_in_flight",
        "Requests posted to the plugin and not finished, per lane",
        lane_labels,
    );
    let queued = gauge(
        "tcpxd_lane_queued",
        "Chunks waiting for a window slot, per lane",
        lane_labels,
    );
    let credits = gauge(
        "tcpxd_lane_credits",
        "Eager credits: held for sending (direction send), credit receives posted without data (recv)",
        lane_labels,
    );
    let credit_limit = gauge(
        "tcpxd_lane_credit_limit",
        "Eager credits per lane announced at pairing (0: rendezvous)",
        lane_labels,
    );
    let peer_state = gauge(
        "tcpxd_peer_state",
        "1 for each peer's current state (connecting, up, failed)",
        &["peer", "state"],
    );
    let peer_transfers = counter_vec(
        &r,
        "tcpxd_peer_transfers_total",
        "Transfers this node started with a peer, by result: started, ok, failed",
        &["peer", "result"],
    );
    let peer_idle_closes = counter_vec(
        &r,
        "tcpxd_peer_idle_closes_total",
        "Times pairings with a peer closed when idle (peer.pairing_idle_close_ms)",
        &["peer"],
    );
    let peer_protocol = counter_vec(
        &r,
        "tcpxd_peer_protocol_total",
        "Transfers with a peer by the protocol they went by (eager header or rendezvous offer): sent by this node, or received from the peer",
        &["peer", "direction", "protocol"],
    );
    let single = |name: &str, help: &str, v: i64| {
        let g = IntGauge::new(name, help).expect("valid metric");
        g.set(v);
        r.register(Box::new(g)).expect("registered once");
    };
    single(
        "tcpxd_active_transfers",
        "Transfers not yet finished",
        snap.active_transfers as i64,
    );
    single("tcpxd_buffers", "Registered buffers", node.buffers as i64);
    single(
        "tcpxd_buffer_bytes",
        "Bytes of registered buffers",
        node.buffer_bytes as i64,
    );
    if let Some(available) = node.memory_available {
        single(
            "tcpxd_host_memory_available_bytes",
            "Host memory a registration may still fault in: MemAvailable, under a cgroup v2 limit no more than the limit less the cgroup's use",
            available.min(i64::MAX as u64) as i64,
        );
    }
    single(
        "tcpxd_host_memory_reserve_bytes",
        "Host memory registrations must leave free (transfer.host_memory_reserve_bytes)",
        node.memory_reserve.min(i64::MAX as u64) as i64,
    );
    // The latest slot of a node decides its state; counters add up over its slots and the
    // pairings of it the engine released (`StatsSnapshot::retired`), so they never go back.
    let mut states: HashMap<&str, &PeerLink> = HashMap::new();
    let kept = snap.peers.iter().map(|p| (&p.counters, Some(&p.link)));
    for (c, link) in kept.chain(snap.retired.iter().map(|c| (c, None))) {
        let peer = c.node_id.as_str();
        if let Some(link) = link {
            states.insert(peer, link);
        }
        for (dir, lanes) in [("send", &c.send), ("recv", &c.recv)] {
            // The lanes in use only (`Engine::listed_counters`): a lane that counted something
            // stays listed for the pairing's life and then in the retired totals, so no counter
            // goes back; a routed pairing's never-used catalogue lanes export no series.
            for l in lanes.iter() {
                let lane = l.lane.to_string();
                let labels = [peer, lane.as_str(), dir];
                lane_bytes.with_label_values(&labels).inc_by(l.bytes);
                lane_chunks.with_label_values(&labels).inc_by(l.chunks);
                window_full.with_label_values(&labels).inc_by(l.window_full);
                in_flight.with_label_values(&labels).add(l.posted as i64);
                queued.with_label_values(&labels).add(l.queued as i64);
                credits.with_label_values(&labels).add(i64::from(l.credits));
                credit_limit
                    .with_label_values(&labels)
                    .add(i64::from(l.credit_limit));
            }
        }
        for (result, v) in [
            ("started", c.transfers_started),
            ("ok", c.transfers_ok),
            ("failed", c.transfers_failed),
        ] {
            peer_transfers.with_label_values(&[peer, result]).inc_by(v);
        }
        peer_idle_closes.with_label_values(&[peer]).inc_by(c.idle_closes);
        for (dir, protocol, v) in [
            ("sent", "eager", c.sent_eager),
            ("sent", "rendezvous", c.sent_rendezvous),
            ("received", "eager", c.received_eager),
            ("received", "rendezvous", c.received_rendezvous),
        ] {
            peer_protocol.with_label_values(&[peer, dir, protocol]).inc_by(v);
        }
    }
    for (peer, link) in states {
        for s in ["connecting", "up", "idle", "failed"] {
            peer_state
                .with_label_values(&[peer, s])
                .set(i64::from(link_name(link) == s));
        }
    }
    r
}

pub fn link_name(l: &PeerLink) -> &'static str {
    match l {
        PeerLink::Connecting => "connecting",
        PeerLink::Up | PeerLink::Closing => "up",
        PeerLink::Idle => "idle",
        PeerLink::Failed(_) => "failed",
    }
}

/// The poller's side: when each transfer it tracks started, and its op and size.
#[derive(Debug)]
pub struct Meter {
    pub metrics: Arc<Metrics>,
    started: HashMap<TransferId, (Op, u64, Instant)>,
}

impl Meter {
    pub fn new(metrics: Arc<Metrics>) -> Meter {
        Meter {
            metrics,
            started: HashMap::new(),
        }
    }

    pub fn started(&mut self, id: TransferId, op: Op, total: u64) {
        self.started.insert(id, (op, total, Instant::now()));
    }

    pub fn finished(&mut self, id: TransferId, outcome: &Outcome, bytes_done: u64) {
        if let Some((op, total, at)) = self.started.remove(&id) {
            self.metrics
                .transfer_finished(op, outcome.code, bytes_done, total, at.elapsed());
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{LaneCounters, PeerCounters};
    use crate::peer_stats::PeerStats;

    #[test]
    fn size_classes() {
        assert_eq!(size_class(0), "lt_64k");
        assert_eq!(size_class(64 << 10), "64k_1m");
        assert_eq!(size_class(4 << 20), "1m_16m");
        assert_eq!(size_class(16 << 20), "16m_256m");
        assert_eq!(size_class(1 << 30), "ge_256m");
    }

    #[test]
    fn events_render_and_summarise_alike() {
        let m = Metrics::new();
        let ok = Outcome {
            code: Code::Ok,
            message: String::new(),
            entries: vec![],
            landed: 1 << 20,
        };
        let mut meter = Meter::new(Arc::new(m));
        meter.started(TransferId(1), Op::Write, 1 << 20);
        meter.finished(TransferId(1), &ok, 1 << 20);
        meter.started(TransferId(2), Op::Read, 100);
        let cancelled = Outcome {
            code: Code::Cancelled,
            ..ok.clone()
        };
        meter.finished(TransferId(2), &cancelled, 0);
        // Unknown ids are ignored.
        meter.finished(TransferId(3), &ok, 5);
        let m = meter.metrics.clone();
        m.recv_consumed("host", Duration::from_micros(3), Duration::from_micros(7));
        m.plugin_error(&NetError::Plugin {
            call: "test",
            code: crate::net::abi::NCCL_SYSTEM_ERROR,
            lines: vec![],
        });
        let snap = StatsSnapshot {
            peers: vec![PeerStats {
                counters: PeerCounters {
                    node_id: "b".into(),
                    failed: None,
                    transfers_started: 2,
                    transfers_ok: 1,
                    transfers_failed: 1,
                    sent_eager: 6,
                    sent_rendezvous: 7,
                    received_eager: 8,
                    received_rendezvous: 9,
                    idle_closes: 3,
                    send: vec![LaneCounters {
                        bytes: 1 << 20,
                        chunks: 2,
                        posted: 1,
                        queued: 3,
                        window_full: 4,
                        credits: 5,
                        credit_limit: 16,
                        credit_bytes_out: 0,
                        state: "open",
                        ..LaneCounters::default()
                    }],
                    // A lane in use receiving only: listed with its number.
                    recv: vec![LaneCounters {
                        lane: 5,
                        bytes: 4096,
                        chunks: 1,
                        state: "closed",
                        ..LaneCounters::default()
                    }],
                    ..PeerCounters::default()
                },
                link: PeerLink::Up,
                send_devices: vec![0],
                recv_devices: vec![0],
                send_gpus: vec![None],
                recv_gpus: vec![None],
                direct_control: true,
                direct_messages_sent: 0,
            }],
            // Released pairings of b: their totals add to b's counters, not to its gauges.
            retired: vec![PeerCounters {
                node_id: "b".into(),
                transfers_ok: 3,
                sent_eager: 1,
                send: vec![LaneCounters {
                    bytes: 1 << 20,
                    window_full: 1,
                    ..LaneCounters::default()
                }],
                ..PeerCounters::default()
            }],
            active_transfers: 1,
        };
        let node = NodeGauges {
            buffers: 2,
            buffer_bytes: 4096,
            memory_available: Some(3 << 30),
            memory_reserve: 1 << 30,
        };
        let text = m.render(&snap, &node);
        for line in [
            "tcpxd_transfers_total{op=\"write\",status=\"ok\"} 1",
            "tcpxd_transfers_total{op=\"read\",status=\"cancelled\"} 1",
            "tcpxd_transfer_bytes_total{op=\"write\",status=\"ok\"} 1048576",
            "tcpxd_transfer_duration_seconds_count{op=\"write\",size_class=\"1m_16m\"} 1",
            "tcpxd_unpack_seconds_count{kind=\"host\"} 1",
            "tcpxd_recv_to_consume_seconds_count 1",
            "tcpxd_plugin_errors_total{code=\"ncclSystemError\"} 1",
            "tcpxd_lane_bytes_total{direction=\"send\",lane=\"0\",peer=\"b\"} 2097152",
            "tcpxd_lane_bytes_total{direction=\"recv\",lane=\"5\",peer=\"b\"} 4096",
            "tcpxd_lane_window_full_total{direction=\"send\",lane=\"0\",peer=\"b\"} 5",
            "tcpxd_lane_in_flight{direction=\"send\",lane=\"0\",peer=\"b\"} 1",
            "tcpxd_lane_queued{direction=\"send\",lane=\"0\",peer=\"b\"} 3",
            "tcpxd_lane_credits{direction=\"send\",lane=\"0\",peer=\"b\"} 5",
            "tcpxd_lane_credit_limit{direction=\"send\",lane=\"0\",peer=\"b\"} 16",
            "tcpxd_peer_state{peer=\"b\",state=\"up\"} 1",
            "tcpxd_peer_protocol_total{direction=\"sent\",peer=\"b\",protocol=\"eager\"} 7",
            "tcpxd_peer_protocol_total{direction=\"received\",peer=\"b\",protocol=\"rendezvous\"} 9",
            "tcpxd_peer_state{peer=\"b\",state=\"failed\"} 0",
            "tcpxd_peer_state{peer=\"b\",state=\"idle\"} 0",
            "tcpxd_peer_idle_closes_total{peer=\"b\"} 3",
            "tcpxd_peer_transfers_total{peer=\"b\",result=\"ok\"} 4",
            "tcpxd_active_transfers 1",
            "tcpxd_buffers 2",
            "tcpxd_buffer_bytes 4096",
            "tcpxd_host_memory_available_bytes 3221225472",
            "tcpxd_host_memory_reserve_bytes 1073741824",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        let start: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("tcpxd_start_time_seconds "))
            .expect("the start time is exported")
            .parse()
            .unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(start > now - 600.0 && start <= now, "{start} against {now}");
        // Unreadable memory figures leave the series out, not at a made-up 0.
        let text = m.render(&snap, &NodeGauges::default());
        assert!(!text.contains("tcpxd_host_memory_available_bytes"), "{text}");
        let s = m.summary();
        assert_eq!(s.transfers[&("write".into(), "ok".into())], (1, 1 << 20));
        assert_eq!(s.transfers[&("read".into(), "cancelled".into())], (1, 0));
        assert_eq!(s.latency[&("write".into(), "1m_16m".into())].count, 1);
        assert!(!s.latency.contains_key(&("read".into(), "lt_64k".into())));
        assert_eq!(s.unpack["host"].count, 1);
        assert_eq!(s.recv_to_consume.count, 1);
        assert_eq!(s.recv_to_consume.buckets.len(), CHUNK_BUCKETS.len());
        assert_eq!(s.plugin_errors["ncclSystemError"], 1);
        assert_eq!(s.ok_and_failed(), (1, 1), "the stop line's totals");
        assert_eq!(s.transfers.len(), 2, "no zero entries: {:?}", s.transfers);
        assert_eq!(s.plugin_errors.len(), 1, "no zero entries: {:?}", s.plugin_errors);
        assert!(
            text.contains("tcpxd_plugin_errors_total{code=\"ncclRemoteError\"} 0"),
            "every code exported from 0: {text}"
        );
        assert!(
            text.contains("tcpxd_transfers_total{op=\"read\",status=\"deadline_exceeded\"} 0"),
            "every status exported from 0: {text}"
        );
    }
}
