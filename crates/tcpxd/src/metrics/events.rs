//! The event series the poller records as they happen ([`Metrics`]): transfers and bytes by op
//! and status, latency per size class, unpack time, time from a receive's completion to its
//! consumption, plugin errors by code, restarts' re-attachments; rendered with the snapshot's
//! series at each scrape, and summarised for `GetStats` ([`Summary`]).

use std::collections::BTreeMap;
use std::time::Duration;

use prometheus::core::{Collector, Metric as _};
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Registry, TextEncoder,
};

use super::labels::{
    ALL_CODES, CHUNK_BUCKETS, LATENCY_BUCKETS, Op, PLUGIN_ERROR_CODES, SIZE_CLASSES, size_class,
    size_class_index, status_label,
};
use super::snapshot::{NodeGauges, snapshot_registry};
use super::{counter_vec, histogram_vec};
use crate::engine::Code;
use crate::net::NetError;
use crate::peer_stats::StatsSnapshot;

/// The event series of one daemon.
pub struct Metrics {
    registry: Registry,
    transfers: IntCounterVec,
    bytes: IntCounterVec,
    latency: HistogramVec,
    unpack: HistogramVec,
    /// `unpack`'s two series, resolved at their first receive (no label lookup per receive; a
    /// kind never seen is never exported).
    unpack_kinds: [std::sync::OnceLock<Histogram>; 2],
    /// `transfers`, `bytes` and `latency`'s series of a successful WRITE and READ, looked up
    /// once (`transfer_finished`, per transfer on the poller: three label lookups, each a hash
    /// of its strings and a lock, before session 32).
    ok_series: [std::sync::OnceLock<OkSeries>; 2],
    recv_to_consume: Histogram,
    plugin_errors: IntCounterVec,
    reattached: IntCounterVec,
    reattach_forgotten: prometheus::IntCounter,
    reattach_pending: prometheus::IntGauge,
    stale_rx_rules: prometheus::IntCounter,
    passes: IntCounterVec,
    pass_seconds: prometheus::CounterVec,
    phase_seconds: prometheus::CounterVec,
    action_seconds: prometheus::CounterVec,
}

/// The phases of a poller pass, in the order a pass runs them (`tcpxd_poller_busy_phase_seconds_total`'s
/// `phase` label; `poller::pass_clock`'s `PassPhase` indexes it): `intake` the look at the sockets,
/// the framed sessions and the direct control connections' reads; `commands` the API's commands;
/// `setup` the lanes' connects and accepts and the completions the last pass left applied to the
/// engine (`drive_setup`); `actions` the engine's actions run (prepared slices, the actions after
/// the lanes' test and the tick); `tick` the engine's tick (deadlines, orphans, drain, lanes); `test_lanes` the plugin's `test` on every lane and the completions;
/// `consume` the landed chunks' unpack, consume and their actions; `flush` the direct
/// connections' writes, the API's answers and the drain's check.
pub const POLLER_PHASES: [&str; 8] = [
    "intake",
    "commands",
    "setup",
    "actions",
    "test_lanes",
    "tick",
    "consume",
    "flush",
];

/// The slots of the busy passes' engine actions, wherever in the pass they ran (the `actions`
/// phase, and the runs inside `commands` and `consume`; `tcpxd_poller_action_seconds_total{kind}`):
/// the engine's action kinds, then `send_direct` (the direct connections' batched writes), `progress_flush`,
/// `lane_orders` (the batch's orders sent to the lane threads) and `submit_gathers` (the GPU
/// gathers' launch).
pub const POLLER_ACTION_SLOTS: usize = crate::engine::ACTION_KINDS.len() + 4;

/// [`POLLER_ACTION_SLOTS`]' names.
pub const POLLER_ACTION_KINDS: [&str; POLLER_ACTION_SLOTS] = {
    let mut names = [""; POLLER_ACTION_SLOTS];
    let mut i = 0;
    while i < crate::engine::ACTION_KINDS.len() {
        names[i] = crate::engine::ACTION_KINDS[i];
        i += 1;
    }
    names[i] = "send_direct";
    names[i + 1] = "progress_flush";
    names[i + 2] = "lane_orders";
    names[i + 3] = "submit_gathers";
    names
};

/// The poller's pass series resolved once ([`Metrics::pass_counters`]): each pass adds to them
/// without a label lookup.
#[derive(Clone)]
pub struct PassCounters {
    /// Passes that made progress, and their time.
    pub busy: (prometheus::IntCounter, prometheus::Counter),
    /// Passes that found nothing to do, and their time (the wait after them not included).
    pub idle: (prometheus::IntCounter, prometheus::Counter),
    /// Busy passes' time by phase ([`POLLER_PHASES`]).
    pub busy_phases: [prometheus::Counter; POLLER_PHASES.len()],
    /// Busy passes' actions by kind ([`POLLER_ACTION_KINDS`]).
    pub busy_actions: [prometheus::Counter; POLLER_ACTION_SLOTS],
}

impl PassCounters {
    /// One pass of the poller's loop: `took` from its start to its end, before any wait.
    pub fn pass(&self, progressed: bool, took: Duration) {
        let (n, t) = if progressed { &self.busy } else { &self.idle };
        n.inc();
        t.inc_by(took.as_secs_f64());
    }

    /// A busy pass's actions' time by kind ([`POLLER_ACTION_KINDS`]' order); slots at zero add
    /// nothing.
    pub fn busy_actions(&self, spent: &[Duration; POLLER_ACTION_SLOTS]) {
        for (c, d) in self.busy_actions.iter().zip(spent) {
            if !d.is_zero() {
                c.inc_by(d.as_secs_f64());
            }
        }
    }

    /// A busy pass's time by phase ([`POLLER_PHASES`]'s order).
    pub fn busy_phases(&self, spent: &[Duration; POLLER_PHASES.len()]) {
        for (c, d) in self.busy_phases.iter().zip(spent) {
            c.inc_by(d.as_secs_f64());
        }
    }
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
            unpack_kinds: Default::default(),
            ok_series: Default::default(),
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
            passes: counter_vec(
                &r,
                "tcpxd_poller_passes_total",
                "Passes of the poller's loop, by whether they made progress (progress=\"yes\") or found nothing to do",
                &["progress"],
            ),
            pass_seconds: {
                let c = prometheus::CounterVec::new(
                    prometheus::Opts::new(
                        "tcpxd_poller_pass_seconds_total",
                        "Time in the poller's passes (not in its waits between them), by progress: the busy share of its thread is the rate of progress=\"yes\"",
                    ),
                    &["progress"],
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("registered once");
                c
            },
            phase_seconds: {
                let c = prometheus::CounterVec::new(
                    prometheus::Opts::new(
                        "tcpxd_poller_busy_phase_seconds_total",
                        "Time in the poller's busy passes (progress=\"yes\") by phase: intake, commands, setup, actions, test_lanes, tick, consume, flush (an estimate: one pass in 8, picked at random, is timed and counts 8 times)",
                    ),
                    &["phase"],
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("registered once");
                for p in POLLER_PHASES {
                    c.with_label_values(&[p]);
                }
                c
            },
            action_seconds: {
                let c = prometheus::CounterVec::new(
                    prometheus::Opts::new(
                        "tcpxd_poller_action_seconds_total",
                        "Time in the busy passes' engine actions (wherever in the pass they ran) by what ran: each engine action kind, send_direct, progress_flush, lane_orders, submit_gathers (an estimate: one pass in 8, picked at random, is timed and counts 8 times)",
                    ),
                    &["kind"],
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
        if code == Code::Ok {
            let ok = self.ok_series[op as usize].get_or_init(|| OkSeries {
                transfers: self.transfers.with_label_values(&[op.as_str(), "ok"]),
                bytes: self.bytes.with_label_values(&[op.as_str(), "ok"]),
                latency: Default::default(),
            });
            ok.transfers.inc();
            ok.bytes.inc_by(bytes);
            let i = size_class_index(total);
            ok.latency[i]
                .get_or_init(|| self.latency.with_label_values(&[op.as_str(), SIZE_CLASSES[i]]))
                .observe(took.as_secs_f64());
            return;
        }
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
        let secs = unpack.as_secs_f64();
        let slot = match kind {
            "host" => Some(&self.unpack_kinds[0]),
            "gpu" => Some(&self.unpack_kinds[1]),
            _ => None,
        };
        match slot {
            Some(h) => h
                .get_or_init(|| self.unpack.with_label_values(&[kind]))
                .observe(secs),
            None => self.unpack.with_label_values(&[kind]).observe(secs),
        }
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

    /// The poller's pass series, resolved for its loop.
    pub fn pass_counters(&self) -> PassCounters {
        let pair = |label: &str| {
            (
                self.passes.with_label_values(&[label]),
                self.pass_seconds.with_label_values(&[label]),
            )
        };
        PassCounters {
            busy: pair("yes"),
            idle: pair("no"),
            busy_phases: POLLER_PHASES.map(|p| self.phase_seconds.with_label_values(&[p])),
            busy_actions: POLLER_ACTION_KINDS.map(|k| self.action_seconds.with_label_values(&[k])),
        }
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

/// A successful transfer's series of one op ([`Metrics::transfer_finished`]).
#[derive(Debug)]
struct OkSeries {
    transfers: IntCounter,
    bytes: IntCounter,
    /// By [`SIZE_CLASSES`]' order.
    latency: [std::sync::OnceLock<Histogram>; 5],
}
